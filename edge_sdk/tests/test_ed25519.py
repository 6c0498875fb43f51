"""edge_sdk._ed25519 (pure-Python RFC 8032 verification) against RFC 8032 section 7.1's test vectors and
malformed keys and signatures. Cross-checks with ``cryptography`` live in tests/test_signing.py (this stage
runs without it)."""
from __future__ import annotations

import pytest

from edge_sdk._ed25519 import BACKENDS, L, P, SignatureError, is_valid, public_key, verify

# RFC 8032 section 7.1: (public key, message, signature); the secret keys are in tests/test_signing.py
RFC8032 = {
    "TEST 1": ("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a", "",
               "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e06522490155"
               "5fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"),
    "TEST 2": ("3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c", "72",
               "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da"
               "085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00"),
    "TEST 3": ("fc51cd8e6218a1a38da47ed00230f0580816ed13ba3303ac5deb911548908025", "af82",
               "6291d657deec24024827e69c3abe01a30ce548a284743a445e3680d7db5ac3ac"
               "18ff9b538d16f290ae67f760984dc6594a7c15e9716ed28dc027beceea1ec40a"),
    "TEST 1024": ("278117fc144c72340f67d0f2316e8386ceffbf2b2428c9c51fef7c597f1d426e",
                  "08b8b2b733424243760fe426a4b54908632110a66c2f6591eabd3345e3e4eb98"
                  "fa6e264bf09efe12ee50f8f54e9f77b1e355f6c50544e23fb1433ddf73be84d8"
                  "79de7c0046dc4996d9e773f4bc9efe5738829adb26c81b37c93a1b270b20329d"
                  "658675fc6ea534e0810a4432826bf58c941efb65d57a338bbd2e26640f89ffbc"
                  "1a858efcb8550ee3a5e1998bd177e93a7363c344fe6b199ee5d02e82d522c4fe"
                  "ba15452f80288a821a579116ec6dad2b3b310da903401aa62100ab5d1a36553e"
                  "06203b33890cc9b832f79ef80560ccb9a39ce767967ed628c6ad573cb116dbef"
                  "efd75499da96bd68a8a97b928a8bbc103b6621fcde2beca1231d206be6cd9ec7"
                  "aff6f6c94fcd7204ed3455c68c83f4a41da4af2b74ef5c53f1d8ac70bdcb7ed1"
                  "85ce81bd84359d44254d95629e9855a94a7c1958d1f8ada5d0532ed8a5aa3fb2"
                  "d17ba70eb6248e594e1a2297acbbb39d502f1a8c6eb6f1ce22b3de1a1f40cc24"
                  "554119a831a9aad6079cad88425de6bde1a9187ebb6092cf67bf2b13fd65f270"
                  "88d78b7e883c8759d2c4f5c65adb7553878ad575f9fad878e80a0c9ba63bcbcc"
                  "2732e69485bbc9c90bfbd62481d9089beccf80cfe2df16a2cf65bd92dd597b07"
                  "07e0917af48bbb75fed413d238f5555a7a569d80c3414a8d0859dc65a46128ba"
                  "b27af87a71314f318c782b23ebfe808b82b0ce26401d2e22f04d83d1255dc51a"
                  "ddd3b75a2b1ae0784504df543af8969be3ea7082ff7fc9888c144da2af58429e"
                  "c96031dbcad3dad9af0dcbaaaf268cb8fcffead94f3c7ca495e056a9b47acdb7"
                  "51fb73e666c6c655ade8297297d07ad1ba5e43f1bca32301651339e22904cc8c"
                  "42f58c30c04aafdb038dda0847dd988dcda6f3bfd15c4b4c4525004aa06eeff8"
                  "ca61783aacec57fb3d1f92b0fe2fd1a85f6724517b65e614ad6808d6f6ee34df"
                  "f7310fdc82aebfd904b01e1dc54b2927094b2db68d6f903b68401adebf5a7e08"
                  "d78ff4ef5d63653a65040cf9bfd4aca7984a74d37145986780fc0b16ac451649"
                  "de6188a7dbdf191f64b5fc5e2ab47b57f7f7276cd419c17a3ca8e1b939ae49e4"
                  "88acba6b965610b5480109c8b17b80e1b7b750dfc7598d5d5011fd2dcc5600a3"
                  "2ef5b52a1ecc820e308aa342721aac0943bf6686b64b2579376504ccc493d97e"
                  "6aed3fb0f9cd71a43dd497f01f17c0e2cb3797aa2a2f256656168e6c496afc5f"
                  "b93246f6b1116398a346f1a641f3b041e989f7914f90cc2c7fff357876e506b5"
                  "0d334ba77c225bc307ba537152f3f1610e4eafe595f6d9d90d11faa933a15ef1"
                  "369546868a7f3a45a96768d40fd9d03412c091c6315cf4fde7cb68606937380d"
                  "b2eaaa707b4c4185c32eddcdd306705e4dc1ffc872eeee475a64dfac86aba41c"
                  "0618983f8741c5ef68d3a101e8a3b8cac60c905c15fc910840b94c00a0b9d0",
                  "0aab4c900501b3e24d7cdf4663326a3a87df5e4843b2cbdb67cbf6e460fec350"
                  "aa5371b1508f9f4528ecea23c436d94b5e8fcd4f681e30a6ac00a9704a188a03"),
    "TEST SHA(abc)": ("ec172b93ad5e563bf4932c70e1245034c35467ef2efd4d64ebf819683467e2bf",
                      "ddaf35a193617abacc417349ae20413112e6fa4e89a97ea20a9eeee64b55d39a"
                      "2192992a274fc1a836ba3c23a3feebbd454d4423643ce80e2a9ac94fa54ca49f",
                      "dc2a4459e7369633a52b1bf277839a00201009a3efbf3ecb69bea2186c26b589"
                      "09351fc9ac90b3ecfdfbc7c66431e0303dca179c138ac17ad9bef1177331a704"),
}
VECTORS = {name: tuple(bytes.fromhex(h) for h in v) for name, v in RFC8032.items()}


@pytest.mark.parametrize("name", list(VECTORS))
def test_rfc8032_vectors_verify(name: str) -> None:
    key, msg, sig = VECTORS[name]
    verify(key, msg, sig)
    assert is_valid(key, msg, sig)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("name", list(VECTORS))
def test_every_backend_agrees_on_the_rfc8032_vectors(name: str, backend: str) -> None:
    """The pure fallback and each installed library (cryptography, PyNaCl): every vector verifies, and the
    same corruptions fail with the same messages (tests/test_signing.py requires both libraries present)."""
    key, msg, sig = VECTORS[name]
    verify(key, msg, sig, backend=backend)
    for i in (0, 31, 32, 63):
        bad = bytearray(sig)
        bad[i] ^= 0x01
        assert not is_valid(key, msg, bytes(bad), backend=backend), i
    with pytest.raises(SignatureError, match="does not verify"):
        verify(key, msg + b"\0", sig, backend=backend)
    s = int.from_bytes(sig[32:], "little")
    with pytest.raises(SignatureError, match="S >= L"):
        verify(key, msg, sig[:32] + (s + L).to_bytes(32, "little"), backend=backend)
    with pytest.raises(SignatureError, match="signature R is not a canonical"):
        verify(key, msg, (P + 1).to_bytes(32, "little") + sig[32:], backend=backend)


def test_unknown_backend_is_named() -> None:
    key, msg, sig = VECTORS["TEST 1"]
    with pytest.raises(ValueError, match="unknown Ed25519 backend 'gpg'; available: .*pure"):
        verify(key, msg, sig, backend="gpg")


@pytest.mark.parametrize("name", list(VECTORS))
def test_any_flipped_bit_fails(name: str) -> None:
    key, msg, sig = VECTORS[name]
    for i in (0, 17, 31, 32, 50, 63):  # R and S
        bad = bytearray(sig)
        bad[i] ^= 0x01
        assert not is_valid(key, msg, bytes(bad)), i
    assert not is_valid(key, msg + b"\0", sig)
    if msg:
        assert not is_valid(key, bytes([msg[0] ^ 0x80]) + msg[1:], sig)
    other = VECTORS["TEST 2" if name == "TEST 1" else "TEST 1"][0]
    with pytest.raises(SignatureError, match="does not verify"):
        verify(other, msg, sig)


def test_non_canonical_s_is_refused() -> None:
    """S + L verifies the same group equation; RFC 8032 5.1.7 requires S < L (no malleability)."""
    key, msg, sig = VECTORS["TEST 1"]
    s = int.from_bytes(sig[32:], "little")
    with pytest.raises(SignatureError, match="S >= L"):
        verify(key, msg, sig[:32] + (s + L).to_bytes(32, "little"))
    with pytest.raises(SignatureError, match="S >= L"):
        verify(key, msg, sig[:32] + L.to_bytes(32, "little"))


def test_non_canonical_points_are_refused() -> None:
    key, msg, sig = VECTORS["TEST 1"]
    y_ge_p = (P + 1).to_bytes(32, "little")  # y = 1 written as p + 1
    with pytest.raises(SignatureError, match=r"public key is not a canonical point encoding \(y >= p"):
        public_key(y_ge_p)
    with pytest.raises(SignatureError, match="signature R is not a canonical"):
        verify(key, msg, y_ge_p + sig[32:])
    x0_sign1 = (1 | 1 << 255).to_bytes(32, "little")  # y = 1 has x = 0; sign bit 1 is non-canonical
    with pytest.raises(SignatureError, match="x = 0 with sign bit 1"):
        public_key(x0_sign1)
    not_on_curve = (2).to_bytes(32, "little")  # y = 2: (y^2 - 1)/(d y^2 + 1) is not a square
    with pytest.raises(SignatureError, match="does not decode to a curve point"):
        public_key(not_on_curve)


@pytest.mark.parametrize("key", [bytes(32), (1).to_bytes(32, "little"), (P - 1).to_bytes(32, "little")])
def test_small_order_public_keys_are_refused(key: bytes) -> None:
    """(0, 1) identity, (sqrt(-1), 0) of order 4, (0, -1) of order 2: each would verify forgeries."""
    with pytest.raises(SignatureError, match="small order"):
        public_key(key)
    forged = (1).to_bytes(32, "little") + bytes(32)  # R = identity, S = 0
    assert not is_valid(key, b"any message", forged)


@pytest.mark.parametrize("key, sig, message", [
    (b"\x01" * 31, b"\0" * 64, "public key is 32 bytes, got 31 bytes"),
    ("d75a98", b"\0" * 64, "public key is 32 bytes, got str"),
    (None, b"\0" * 64, "got NoneType"),
    (VECTORS["TEST 1"][0], b"\0" * 63, "signature is 64 bytes, got 63 bytes"),
    (VECTORS["TEST 1"][0], b"\0" * 65, "signature is 64 bytes, got 65 bytes"),
    (VECTORS["TEST 1"][0], "sig", "signature is 64 bytes, got str"),
])
def test_malformed_lengths_and_types(key: object, sig: object, message: str) -> None:
    with pytest.raises(SignatureError, match=message):
        verify(key, b"", sig)  # type: ignore[arg-type]
