"""``GET /``: a plain server-rendered dashboard (jobs with their round curves as inline SVG, bundles,
joined clients); it reloads itself every few seconds while jobs run."""
from __future__ import annotations

import html
import time
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse

from fl_server.diagnostics import scored_model
from fl_server.service.routes import service
from fl_server.service.state import Service

router = APIRouter()
CSS = """body{font:14px system-ui,sans-serif;margin:24px;color:#222}h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse}td,th{border-bottom:1px solid #ddd;padding:4px 10px;text-align:left;vertical-align:top}
.done{color:#1a7f37}.failed,.cancelled{color:#c62828}.running{color:#9a6700}.queued{color:#666}code{font-size:12px}
svg{background:#fafafa;border:1px solid #eee}"""


def curve_svg(rounds: list[dict[str, Any]], total: int, w: int = 260, h: int = 90) -> str:
    """Validation accuracy (%) per round as an SVG polyline; x spans the job's planned rounds."""
    pts = [(r["round"], r["val"]) for r in rounds if r.get("val") is not None]
    if not pts:
        return '<svg width="260" height="90"><text x="8" y="48" fill="#999">no rounds yet</text></svg>'
    sx = (w - 30) / max(1, total - 1)
    xy = " ".join(f"{25 + r * sx:.1f},{h - 12 - v * (h - 22):.1f}" for r, v in pts)
    last = pts[-1][1]
    return (f'<svg width="{w}" height="{h}" role="img" aria-label="validation accuracy per round">'
            f'<line x1="25" y1="{h - 12}" x2="{w - 5}" y2="{h - 12}" stroke="#bbb"/>'
            f'<line x1="25" y1="10" x2="25" y2="{h - 12}" stroke="#bbb"/>'
            f'<text x="2" y="14" font-size="10" fill="#888">100</text><text x="10" y="{h - 10}" font-size="10" '
            f'fill="#888">0</text><polyline fill="none" stroke="#1f6feb" stroke-width="2" points="{xy}"/>'
            f'<text x="{w - 90}" y="{h - 16}" font-size="11" fill="#1f6feb">val {100 * last:.1f}%</text></svg>')


def _ago(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
def dashboard(svc: Service = Depends(service)) -> HTMLResponse:
    e = html.escape
    jobs = svc.jobs()
    rows = []
    for j in jobs:
        rounds = svc.job_rounds(j["id"])
        spec = j["spec"]  # a recipe job holds only the fields it set: the rest is its recipe's
        data = "a recipe" if spec.get("recipe") else spec["dataset"]  # public page: no recipe file names
        outcome = svc.job_outcome(j)
        accuracy = outcome["new_client_accuracy"]  # what a device gets from the job's bundle
        subject = scored_model(outcome["test_of"], outcome["safeguard"], outcome["method"] or "its method",
                               outcome["labeled_device_accuracy"])
        kept = f" ({e(subject)})" if subject else ""
        rows.append(f'<tr><td><code>{e(j["id"])}</code>{" (default)" if j["is_default"] else ""}</td>'
                    f'<td>{e(outcome["method"] or "its own")}</td><td>{e(data)} / '
                    f'{e(spec.get("partition", "its own"))}</td><td class="{e(j["status"])}">{e(j["status"])}</td>'
                    f'<td>{len(rounds)} / {spec.get("rounds", "?")}</td>'
                    f'<td>{curve_svg(rounds, spec.get("rounds", len(rounds)))}</td>'
                    f'<td>{"-" if accuracy is None else f"{100 * accuracy:.1f}%{kept}"}</td>'
                    # the page is public: a failure's log tail (paths, tracebacks) is for the admin API only
                    f'<td>{"see GET /v1/jobs/" + e(j["id"]) + " (admin)" if j["error"] else ""}</td></tr>')
    bundles = [f'<tr><td><code>{e(b["id"][:16])}</code></td><td>{e(b["method"])}</td><td>{e(b["dataset"])}</td>'
               f'<td>{len(b["manifest"]["artifacts"])}</td><td>{sum(a["size"] for a in b["manifest"]["artifacts"]):,}'
               f'</td><td>{_ago(b["created"])}</td></tr>' for b in svc.recorded_bundles()]
    # the page is public: no client id (nor a prefix of one) is shown, only what clients joined for and when
    clients = [f'<tr><td>{e(c["method"] or "")}</td><td>{_ago(c["created"])}</td><td>{_ago(c["first_used"])}</td>'
               '</tr>' for c in svc.latest_clients(50)]
    degraded = "".join(f'<tr><td>{e(m)}</td><td class="failed">{e(why)}</td></tr>'
                       for m, why in svc.degraded().items())
    live = any(j["status"] in ("queued", "running") for j in jobs)
    totals = svc.totals()
    body = f"""<!doctype html><html><head><meta charset="utf-8"><title>fl-edge coordinator</title>
{'<meta http-equiv="refresh" content="3">' if live else ''}<style>{CSS}</style></head><body>
<h1>fl-edge coordinator</h1><p>{len(jobs)} jobs, {len(bundles)} bundles, {totals["clients"]} clients,
{totals["dles"]} BTFL DLEs &middot; <a href="/docs">API docs</a> &middot; <a href="/metrics">metrics</a></p>
{'<h2>Degraded</h2><table><tr><th>method</th><th>why</th></tr>' + degraded + '</table>' if degraded else ''}
<h2>Jobs</h2><table><tr><th>id</th><th>method</th><th>data / partition</th><th>status</th><th>rounds</th>
<th>validation accuracy per round</th><th>new clients' accuracy (the bundle's)</th><th>error</th></tr>{''.join(rows)}</table>
<h2>Bundles</h2><table><tr><th>bundle</th><th>method</th><th>data set</th><th>artifacts</th><th>bytes</th>
<th>created</th></tr>{''.join(bundles)}</table>
<h2>Clients (latest 50)</h2><table><tr><th>method</th><th>joined</th>
<th>first authenticated request</th></tr>
{''.join(clients)}</table></body></html>"""
    return HTMLResponse(body)
