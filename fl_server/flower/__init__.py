"""Federated training on Flower (needs the ``flower`` extra: ``pip install 'fl-edge[flower]'``).

``server_app.app`` (ServerApp) and ``client_app.app`` (ClientApp) run a recipe with the in-process engine's own
per-client step and aggregation; ``superexec`` is a SuperNode's SuperExec that starts each message's ClientApp
process as a warm fork (``python -m fl_server.flower.superexec``); ``examples/flower`` is the app folder ``flwr run``
takes; ``examples/loopback_flower.py`` starts a SuperLink and SuperNodes on loopback (tests, benchmarks,
``examples/flower_devices.py``). Nothing here is imported by the rest of the package, so fl-edge works without
Flower installed.
"""
