"""The SDK's bundle errors (one module so that bundle.py and signing.py share them)."""
from __future__ import annotations


class BundleError(ValueError):
    """A bundle is missing, malformed, or does not match its manifest."""


class BundleSignatureError(BundleError):
    """A bundle's signature is missing, malformed, from another key, or does not match its manifest."""


class BundleExpiredError(BundleSignatureError):
    """A bundle's signed release is past its ``expires`` time: a stale or replayed manifest (freeze attack)."""


class BundleRollbackError(BundleSignatureError):
    """A bundle's signed release is older than the newest this device accepted for its method (rollback)."""
