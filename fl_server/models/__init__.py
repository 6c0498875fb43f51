"""Model zoo (classifiers with separate feature extractor and head, FedTTA's adaptation model)."""
from fl_server.models.zoo import MODELS, AdaptationMLP, Classifier, build_model

__all__ = ["MODELS", "AdaptationMLP", "Classifier", "build_model"]
