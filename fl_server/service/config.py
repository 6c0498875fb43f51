"""Coordinator settings: a dataclass with defaults, overridable from the environment (``FL_SERVE_*``)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def load_plugins() -> None:
    """Import the operator's plugins, ``FL_SERVE_PLUGINS`` (comma-separated ``path/file.py`` or installed module
    names), so that the methods and device step graph builders they register are known here: jobs train them,
    publishing checks their bundles. Runs before the settings are read (:func:`fl_server.service.create_app`, a
    job's worker, ``fl-server publish --store``); a file is run once per process. No other file is imported:
    a job names a recipe only from ``FL_SERVE_RECIPES_DIR``, and nothing received over the network is code."""
    from fl_server.recipes.errors import RecipeError
    from fl_server.recipes.loader import import_plugin

    for entry in _env_list("FL_SERVE_PLUGINS", ()):
        try:
            import_plugin(entry)
        except RecipeError as exc:
            raise ValueError(f"FL_SERVE_PLUGINS: {exc}") from None


def servable_methods() -> tuple[str, ...]:
    """Every registered method that declares a device path (``Algorithm.servable``): built-in, or registered by a
    plugin (:func:`load_plugins`) or a recipe file imported before the coordinator starts."""
    from fl_server.algorithms import ALGORITHMS

    return tuple(name for name, cls in ALGORITHMS.items() if cls.servable)


def served_methods() -> tuple[str, ...]:
    """The methods a coordinator trains as jobs: ``FL_SERVE_METHODS`` (comma-separated), else every servable one."""
    return _env_list("FL_SERVE_METHODS", servable_methods())


def default_methods() -> tuple[str, ...]:
    """The registered methods that declare themselves default jobs (``Algorithm.default_job``), in registration
    order: what an empty store trains unless ``FL_SERVE_DEFAULT_METHODS`` says otherwise, and the order in which
    a device that names no method is given a bundle."""
    from fl_server.algorithms import ALGORITHMS

    return tuple(name for name, cls in ALGORITHMS.items() if cls.default_job)


DATASETS = ("digits", "mnist", "fashion_mnist")
PARTITIONS = ("pathological", "dirichlet", "iid")


def _env_list(name: str, default: tuple[str, ...]) -> tuple[str, ...]:
    raw = os.environ.get(name)
    return default if raw is None else tuple(m.strip() for m in raw.split(",") if m.strip())


@dataclass
class ServiceConfig:
    store_dir: Path
    # jobs started on the embedded digits when the store is empty; FL_SERVE_DEFAULT_METHODS="" disables them
    default_methods: tuple[str, ...] = field(default_factory=lambda: _env_list("FL_SERVE_DEFAULT_METHODS",
                                                                               default_methods()))
    # the methods this coordinator trains as jobs (FL_SERVE_METHODS="TENT,BTFL"); default: every servable one
    methods: tuple[str, ...] = field(default_factory=served_methods)
    default_rounds: int = field(default_factory=lambda: int(os.environ.get("FL_SERVE_ROUNDS", "60")))
    workers: int = field(default_factory=lambda: int(os.environ.get("FL_SERVE_WORKERS", "1")))
    worker_threads: int = 1  # torch threads per training subprocess (the API keeps the other cores)
    data_dir: str | None = field(default_factory=lambda: os.environ.get("FL_DATA_DIR"))
    # recipes an admin may name in a job (FILE[:NAME] for FILE.py in this directory); None: built-in ones only
    recipes_dir: str | None = field(default_factory=lambda: os.environ.get("FL_SERVE_RECIPES_DIR"))
    admin_token: str | None = field(default_factory=lambda: os.environ.get("FL_ADMIN_TOKEN"))
    # how long a signed release (a bundle's version and expiry) is valid; re-signed after half of it. A device
    # refuses an expired one, so a replayed manifest stops working after this long (freeze protection)
    manifest_ttl_s: float = field(default_factory=lambda: float(os.environ.get("FL_SERVE_MANIFEST_TTL_S", "604800")))
    retry_after_s: int = 5
    max_body_bytes: int = 1 << 20  # 1 MiB: an embedding or a DLE is far smaller
    # a published bundle (POST /v1/bundles, fl-server publish): the whole archive at most
    max_bundle_bytes: int = field(default_factory=lambda: int(os.environ.get("FL_SERVE_MAX_BUNDLE_BYTES",
                                                                             str(256 << 20))))
    # artifacts up to this size are kept in memory (256 MiB in all); larger ones are streamed from disk
    artifact_cache_file_max: int = field(default_factory=lambda: int(os.environ.get(
        "FL_SERVE_ARTIFACT_CACHE_FILE_MAX", str(16 << 20))))
    poll_s: float = 0.5  # job runner: how often progress is read from the run directory
    # rate limits (token buckets): requests/s sustained and burst, per bearer token and per IP for joining;
    # a rate of 0 disables. Generous: 200 devices joining at once from one IP are not throttled.
    token_rate: float = field(default_factory=lambda: float(os.environ.get("FL_SERVE_TOKEN_RATE", "20")))
    token_burst: int = field(default_factory=lambda: int(os.environ.get("FL_SERVE_TOKEN_BURST", "200")))
    join_rate: float = field(default_factory=lambda: float(os.environ.get("FL_SERVE_JOIN_RATE", "20")))
    join_burst: int = field(default_factory=lambda: int(os.environ.get("FL_SERVE_JOIN_BURST", "500")))
    # registered clients at most (0: no cap): joining is unauthenticated, so the per-IP rate alone would let one
    # address add 1.7M clients a day; past the cap a join gets 503
    max_clients: int = field(default_factory=lambda: int(os.environ.get("FL_SERVE_MAX_CLIENTS", "1000000")))
    # at the cap, a join first reclaims clients that never used their token and joined over this many seconds
    # ago (0: never; a client that authenticated once is kept for good)
    unused_client_ttl_s: float = field(default_factory=lambda: float(os.environ.get(
        "FL_SERVE_UNUSED_CLIENT_TTL_S", "86400")))

    # who may join: "token" (default: a join needs an enrollment token from POST /v1/enrollments) or "open"
    # (anyone who can reach the coordinator: `make run`, local trials; never where untrusted devices reach it)
    enrollment: str = field(default_factory=lambda: os.environ.get("FL_SERVE_ENROLLMENT", "token"))
    # BTFL: clients of one source (one enrollment token, or one join address in open mode) whose DLEs count in
    # the global DLE at most; further uploads from that source are refused (a quota on rows, not the weight)
    dle_per_source: int = field(default_factory=lambda: int(os.environ.get("FL_SERVE_DLE_PER_SOURCE", "16")))
    # BTFL: one source's whole weight in the global DLE at most, as a share of the served bundle's training
    # clients (dle_clients): its clients split it, so a source moves any row by <= 2*share/(1+share) (L1)
    dle_source_share: float = field(default_factory=lambda: float(os.environ.get("FL_SERVE_DLE_SOURCE_SHARE",
                                                                                 "0.02")))
    # BTFL: every uploaded DLE together weighs at most this share of the bundle's training clients (they split
    # it), so many tokens or addresses together move any row by <= 2*share/(1+share) too (Sybil)
    dle_uploads_share: float = field(default_factory=lambda: float(os.environ.get("FL_SERVE_DLE_UPLOADS_SHARE",
                                                                                  "0.02")))
    # authenticated requests per second and burst per client address, and per enrollment, on top of the per-token
    # limit: minted tokens do not multiply it (0 disables)
    address_rate: float = field(default_factory=lambda: float(os.environ.get("FL_SERVE_ADDRESS_RATE", "200")))
    address_burst: int = field(default_factory=lambda: int(os.environ.get("FL_SERVE_ADDRESS_BURST", "2000")))
    # refused admin authentications (401/403 on an admin route) per address: per second and burst; past the
    # burst the address gets 429 on admin routes until its bucket refills (0 disables)
    admin_fail_rate: float = field(default_factory=lambda: float(os.environ.get("FL_SERVE_ADMIN_FAIL_RATE", "0.2")))
    admin_fail_burst: int = field(default_factory=lambda: int(os.environ.get("FL_SERVE_ADMIN_FAIL_BURST", "30")))
    # training jobs waiting to start at most (POST /v1/jobs answers 503 beyond; the default jobs are exempt)
    max_queued_jobs: int = field(default_factory=lambda: int(os.environ.get("FL_SERVE_MAX_QUEUED_JOBS", "16")))

    # every stored object is re-hashed this often (s; 0: only at start and when a file changed on disk)
    scrub_s: float = field(default_factory=lambda: float(os.environ.get("FL_SERVE_SCRUB_S", "600")))
    # /healthz reports "degraded" while the store's disk has less free space than this
    min_free_bytes: int = field(default_factory=lambda: int(os.environ.get("FL_SERVE_MIN_FREE_BYTES",
                                                                            str(64 << 20))))

    def __post_init__(self) -> None:
        self.store_dir = Path(self.store_dir)
        servable = servable_methods()
        unknown = [m for m in self.methods if m not in servable]
        if unknown:
            raise ValueError(f"FL_SERVE_METHODS: cannot serve {unknown}; servable methods: {', '.join(servable)}")
        unknown = [m for m in self.default_methods if m not in self.methods]
        if unknown:
            raise ValueError(f"cannot serve {unknown}; this coordinator serves {', '.join(self.methods)}")
        if self.default_rounds < 1 or self.workers < 1:
            raise ValueError("FL_SERVE_ROUNDS and FL_SERVE_WORKERS must be >= 1")
        if self.admin_token and not 16 <= len(self.admin_token) <= 512:
            raise ValueError("FL_ADMIN_TOKEN must have 16 to 512 characters (it guards every admin route)")
        if not self.manifest_ttl_s >= 60:
            raise ValueError("FL_SERVE_MANIFEST_TTL_S must be >= 60 (seconds a signed release stays valid)")
        if self.artifact_cache_file_max < 0:
            raise ValueError("FL_SERVE_ARTIFACT_CACHE_FILE_MAX must be >= 0 (0: stream every artifact from disk)")
        if min(self.token_rate, self.token_burst, self.join_rate, self.join_burst, self.admin_fail_rate,
               self.admin_fail_burst) < 0:
            raise ValueError("FL_SERVE_{TOKEN,JOIN,ADMIN_FAIL}_{RATE,BURST} must be >= 0 (a rate of 0 disables the "
                             "limit)")
        if not self.scrub_s >= 0 or self.min_free_bytes < 0:
            raise ValueError("FL_SERVE_SCRUB_S and FL_SERVE_MIN_FREE_BYTES must be >= 0")
        if self.enrollment not in ("open", "token"):
            raise ValueError("FL_SERVE_ENROLLMENT must be 'open' or 'token'")
        if self.dle_per_source < 1 or min(self.address_rate, self.address_burst) < 0:
            raise ValueError("FL_SERVE_DLE_PER_SOURCE must be >= 1 and FL_SERVE_ADDRESS_{RATE,BURST} >= 0")
        if not 0 < self.dle_uploads_share <= 1:
            raise ValueError("FL_SERVE_DLE_UPLOADS_SHARE must be in (0, 1] (all uploaded DLEs' weight in the global "
                             "DLE, as a share of the served bundle's training clients)")
        if not 0 < self.dle_source_share <= 1:
            raise ValueError("FL_SERVE_DLE_SOURCE_SHARE must be in (0, 1] (one source's weight in the global DLE "
                             "as a share of the bundle's training clients)")
        if self.max_queued_jobs < 1:
            raise ValueError("FL_SERVE_MAX_QUEUED_JOBS must be >= 1")
        if self.max_clients < 0:
            raise ValueError("FL_SERVE_MAX_CLIENTS must be >= 0 (0: no cap)")
        if not self.unused_client_ttl_s >= 0:
            raise ValueError("FL_SERVE_UNUSED_CLIENT_TTL_S must be >= 0 (0: never reclaim unused clients)")
