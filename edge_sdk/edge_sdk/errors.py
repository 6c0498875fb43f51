"""The SDK's bundle errors (one module so that bundle.py and signing.py share them)."""
from __future__ import annotations


class BundleError(ValueError):
    """A bundle is missing, malformed, or does not match its manifest."""


class BundleSignatureError(BundleError):
    """A bundle's signature is missing, malformed, from another key, or does not match its manifest."""
