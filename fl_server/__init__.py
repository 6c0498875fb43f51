"""fl_server: the federated coordinator (data, models, algorithms, simulation engine, results harness)."""
__version__ = "0.1.0"
