"""Ed25519 signature verification (RFC 8032): a maintained library when one is installed, else pure Python
(integers mod p = 2^255 - 19, hashlib's SHA-512).

The device only verifies (the coordinator signs with ``cryptography``). ``cryptography`` (OpenSSL) or PyNaCl
(libsodium) are optional (the SDK's ``fast`` extra): with either, the group equation is checked by the library
(far faster than the fallback); the encodings, S < L and the small-order key check below run on every path, so
all paths refuse the same malformed input with the same message. ``BACKEND`` names the path in use;
``verify(..., backend="pure")`` forces the fallback. Section numbers are RFC 8032's. Not constant time:
verification handles public data only.

    verify(public_key, message, signature)     # raises SignatureError with the reason, else returns None

Beyond the RFC (as libsodium does): a public key of small order (``[8]A`` = identity, e.g. all zeros) is
refused, because such a key accepts forged signatures for any message.
"""
from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable

P = 2**255 - 19  # the field GF(p) (5.1)
L = 2**252 + 27742317777372353535851937790883648493  # order of the base point (5.1)
D = -121665 * pow(121666, -1, P) % P  # curve constant d of -x^2 + y^2 = 1 + d x^2 y^2 (5.1)
SQRT_M1 = pow(2, (P - 1) // 4, P)  # a square root of -1 (5.1.3, step 3)
Point = tuple[int, int, int, int]  # extended homogeneous (X, Y, Z, T): x = X/Z, y = Y/Z, x y = T/Z (5.1.4)
IDENTITY: Point = (0, 1, 1, 0)


class SignatureError(ValueError):
    """A key or signature is malformed, or the signature does not verify."""


def _add(p: Point, q: Point) -> Point:
    """Point addition (5.1.4); the formula is complete on this curve, so it also doubles."""
    a = (p[1] - p[0]) * (q[1] - q[0]) % P
    b = (p[1] + p[0]) * (q[1] + q[0]) % P
    c = 2 * p[3] * q[3] * D % P
    d = 2 * p[2] * q[2] % P
    e, f, g, h = b - a, d - c, d + c, b + a
    return e * f % P, g * h % P, f * g % P, e * h % P


def _double(p: Point) -> Point:
    """Point doubling (5.1.4, the dedicated formula)."""
    a, b, c = p[0] * p[0] % P, p[1] * p[1] % P, 2 * p[2] * p[2] % P
    h = a + b
    e = h - (p[0] + p[1]) ** 2
    g = a - b
    f = c + g
    return e * f % P, g * h % P, f * g % P, e * h % P


def _neg(p: Point) -> Point:
    return (P - p[0]) % P, p[1], p[2], (P - p[3]) % P


def _mul2(s: int, p: Point, k: int, q: Point) -> Point:
    """[s]p + [k]q in one double-and-add pass over both scalars (Straus/Shamir; variable time, which is
    fine: scalars and points are public during verification)."""
    table = {(0, 1): q, (1, 0): p, (1, 1): _add(p, q)}
    acc = IDENTITY
    for i in range(max(s.bit_length(), k.bit_length()) - 1, -1, -1):
        acc = _double(acc)
        bits = ((s >> i) & 1, (k >> i) & 1)
        if bits != (0, 0):
            acc = _add(acc, table[bits])
    return acc


def _equal(p: Point, q: Point) -> bool:
    """Projective equality: x1/z1 = x2/z2 and y1/z1 = y2/z2 (5.1.4)."""
    return (p[0] * q[2] - q[0] * p[2]) % P == 0 and (p[1] * q[2] - q[1] * p[2]) % P == 0


def _decode(s: bytes, what: str) -> Point:
    """Decode a 32-byte point encoding (5.1.3); refuses y >= p, a non-square x^2 and x = 0 with sign 1."""
    n = int.from_bytes(s, "little")
    sign, y = n >> 255, n & ((1 << 255) - 1)
    if y >= P:  # step 1: non-canonical encoding
        raise SignatureError(f"{what} is not a canonical point encoding (y >= p, RFC 8032 5.1.3)")
    u, v = (y * y - 1) % P, (D * y * y + 1) % P
    x = u * pow(v, 3, P) * pow(u * pow(v, 7, P), (P - 5) // 8, P) % P  # step 2: candidate root of u/v
    if (v * x * x - u) % P != 0:  # step 3
        if (v * x * x + u) % P != 0:
            raise SignatureError(f"{what} does not decode to a curve point (RFC 8032 5.1.3)")
        x = x * SQRT_M1 % P
    if x == 0 and sign:  # step 4
        raise SignatureError(f"{what} is not a canonical point encoding (x = 0 with sign bit 1, RFC 8032 5.1.3)")
    if x & 1 != sign:
        x = P - x
    return x, y, 1, x * y % P


B = _decode((4 * pow(5, -1, P) % P).to_bytes(32, "little"), "base point")  # y = 4/5, x even (5.1)


def public_key(data: bytes) -> Point:
    """Decode and check a 32-byte public key (5.1.5 format); small-order keys are refused."""
    if not isinstance(data, (bytes, bytearray)) or len(data) != 32:
        raise SignatureError(f"an Ed25519 public key is 32 bytes, got {_describe(data)}")
    return _checked_key(bytes(data))


@functools.lru_cache(maxsize=64)  # a device verifies against one pinned key over and over
def _checked_key(data: bytes) -> Point:
    a = _decode(data, "public key")
    if _equal(_double(_double(_double(a))), IDENTITY):
        raise SignatureError("public key has small order (it would accept forged signatures); refusing it")
    return a


def _pure_equation(key: bytes, message: bytes, signature: bytes) -> bool:
    """The cofactored equation [8][S]B = [8]R + [8][k]A (5.1.7, steps 2-3), evaluated as
    [8]([S]B - [k]A - R) = identity; inputs already checked by :func:`verify`."""
    a, r = public_key(key), _decode(signature[:32], "signature R")
    s = int.from_bytes(signature[32:], "little")
    k = int.from_bytes(hashlib.sha512(signature[:32] + key + message).digest(),
                       "little") % L  # step 2 (dom2 is empty for Ed25519, 5.1)
    q = _add(_mul2(s, B, k, _neg(a)), _neg(r))  # step 3
    return _equal(_double(_double(_double(q))), IDENTITY)


def _library_backends() -> dict[str, Callable[[bytes, bytes, bytes], bool]]:
    """The installed libraries' Ed25519 verification, each as ``check(key, message, signature) -> bool``."""
    found: dict[str, Callable[[bytes, bytes, bytes], bool]] = {}
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    except Exception:  # absent, or a broken OpenSSL binding: the other paths remain
        pass
    else:
        def openssl(key: bytes, message: bytes, signature: bytes) -> bool:
            try:
                Ed25519PublicKey.from_public_bytes(key).verify(signature, message)
            except InvalidSignature:
                return False
            return True
        found["cryptography"] = openssl
    try:
        from nacl.exceptions import BadSignatureError
        from nacl.signing import VerifyKey
    except Exception:
        pass
    else:
        def libsodium(key: bytes, message: bytes, signature: bytes) -> bool:
            try:
                VerifyKey(key).verify(message, signature)
            except BadSignatureError:
                return False
            return True
        found["pynacl"] = libsodium
    return found


@functools.cache
def _backends() -> dict[str, Callable[[bytes, bytes, bytes], bool]]:
    # found on the first verification, not at import: loading OpenSSL's bindings costs a device ~6 MB of memory
    # that a device which never checks a signature need not hold
    return {**_library_backends(), "pure": _pure_equation}


def __getattr__(name: str) -> object:
    """``BACKENDS`` (name -> check, in order of preference) and ``BACKEND`` (the first available of
    cryptography, pynacl, pure), looked up on first use (PEP 562)."""
    if name == "BACKENDS":
        return _backends()
    if name == "BACKEND":
        return next(iter(_backends()))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def verify(key: bytes, message: bytes, signature: bytes, backend: str | None = None) -> None:
    """Verify an Ed25519 signature (5.1.7). The encodings of A and R (5.1.3), S < L and A's order are
    checked here on every path (R's once the equation failed, to name the cause: a non-canonical R never
    satisfies it); the equation by ``backend`` (default :data:`BACKEND`; ``"pure"`` is this module's
    cofactored check, the libraries use their own, which agree on every honestly made signature).
    Returns None; raises :class:`SignatureError` naming what is wrong.

    Example::

        verify(bytes.fromhex(pinned_hex), manifest_bytes, signature)   # raises if forged or altered
    """
    public_key(key)
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != 64:
        raise SignatureError(f"an Ed25519 signature is 64 bytes, got {_describe(signature)}")
    key, signature = bytes(key), bytes(signature)
    if int.from_bytes(signature[32:], "little") >= L:
        raise SignatureError("signature S is not reduced mod L (S >= L, RFC 8032 5.1.7): non-canonical")
    backends = _backends()
    check = backends.get(backend or next(iter(backends)))
    if check is None:
        raise ValueError(f"unknown Ed25519 backend {backend!r}; available: {', '.join(backends)}")
    if not check(key, bytes(message), signature):
        # step 1 only on failure (a library never accepts a non-canonical R), to name that cause
        _decode(signature[:32], "signature R")
        raise SignatureError("signature does not verify for this message and public key")


def is_valid(key: bytes, message: bytes, signature: bytes, backend: str | None = None) -> bool:
    """``verify`` as a boolean."""
    try:
        verify(key, message, signature, backend)
    except SignatureError:
        return False
    return True


def _describe(x: object) -> str:
    return f"{len(x)} bytes" if isinstance(x, (bytes, bytearray)) else type(x).__name__
