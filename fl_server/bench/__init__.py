"""Results harness: named experiments, resumable seed runs, aggregated tables, docs/RESULTS.md."""
