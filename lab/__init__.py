"""The results lab, beside the product and not in its wheel: the papers' experiments as recipes, resumable seed
runs, aggregated tables, docs/RESULTS.md (``python -m lab bench|report``), the research scripts (lab/research/)
and the lab's own tests (lab/tests/, ``make test-lab``)."""
