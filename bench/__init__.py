"""The benchmark harness: ``python -m bench <subcommand>`` (bench/__main__.py, docs/benchmarks.md).

One runner trains the chosen arms side by side in one job; its parts, each a module:

- tasks.py: the models, data, optimizer recipes and evaluations (``TASKS``);
- arms.py: what sends the gradients, one entry per arm (``ARMS``): Horovod, TopKEF, hvd_topk, DDP;
- links.py: where the ranks run (a namespace with a tbf loopback, or emulated hosts) and the counters;
- runner.py: the side-by-side training in every rank, and the driver that launches it per seed;
- figures.py: the figures of a run, pure functions of its records;
- report.py: the results folder's table.md, summary.json, plots and headline.json;
- manifest.py: the folder's provenance (commit, command, date, machine).

Beside the runner: demo.py (the README's demo), selection.py (the Top-K selection against
torch.topk), scale.py (the cost model's winners), peer_tests.py (Horovod's own optimizer tests),
ab.py (an A/B timer of two commands) and results_page.py (docs/results.md's generated table).
bench/ imports the library and testbed/; nothing in hvd_topk/, testbed/, tests/ or examples/ imports it.
"""
