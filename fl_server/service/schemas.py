"""Request and response bodies of the coordinator API (pydantic; they are the OpenAPI documentation).
Every number that comes in must be finite (``allow_inf_nan=False``) and of a JSON number type (strict: no
``"1.0"``, ``true`` or ``"10"`` where a number belongs), and every list is bounded."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fl_server.recipes.loader import RECIPE_NAME
from fl_server.service.config import DATASETS, PARTITIONS, default_methods

MAX_EMBED_DIM = 4096
MAX_DLE_DIMS = 65536
MAX_DLE_LEVELS = 16
MAX_EMBED_ABS = 1e6  # far beyond any encoder output (DP noise included), far below float32 overflow
MAX_METHOD_CHARS = 64
EmbedValue = Annotated[float, Field(ge=-MAX_EMBED_ABS, le=MAX_EMBED_ABS)]
Frequency = Annotated[float, Field(ge=0, le=1)]
DLERow = Annotated[list[Frequency], Field(min_length=2, max_length=MAX_DLE_LEVELS)]


class Strict(BaseModel):
    """Request bodies: unknown fields refused, numbers finite, no coercion (a string or a boolean where a
    number belongs is a 422; a JSON integer is still a valid float)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class JoinRequest(Strict):
    method: str | None = Field(None, max_length=MAX_METHOD_CHARS,
                               description="test-time method the device will run (default: the "
                                           "coordinator's default bundle); 'none' = plain inference")
    enrollment_token: str | None = Field(None, max_length=512, description="from the operator (POST "
                                         "/v1/enrollments); required when the coordinator runs with "
                                         "FL_SERVE_ENROLLMENT=token, ignored otherwise")


class EnrollmentRequest(Strict):
    uses: int = Field(1, ge=1, le=10**6, description="joins the token allows (one per device is the safest)")
    ttl_s: float | None = Field(None, gt=0, le=366 * 86400, description="seconds until it expires (default: never)")


class Enrollment(BaseModel):
    id: str
    token: str = Field(description="hand it to the device(s) out of band; shown once, stored hashed")
    uses: int
    expires: float | None = Field(None, description="Unix time, or null for never")


class Revoked(BaseModel):
    id: str
    clients_revoked: int = Field(description="clients whose bearer token stopped working")
    dles_removed: int = Field(description="of them, those whose DLE left the global DLE")


class ArtifactRef(BaseModel):
    name: str
    kind: str
    file: str
    sha256: str
    size: int
    url: str = Field(description="GET it here; supports Range and ETag/If-None-Match")
    model_config = ConfigDict(extra="allow")


class ManifestSignature(BaseModel):
    alg: Literal["Ed25519"] = "Ed25519"
    key_id: str = Field(description="first 16 hex characters of the signer's key (key rotation)")
    public_key: str = Field(description="the signer's key (informational: devices verify with the key they pin)")
    release: str = Field(description="the signed release, strict JSON text: bundle_id (sha256 of GET "
                                     "/v1/artifacts/{bundle_id}'s bytes), method, version (rises per method), "
                                     "expires (UTC), key_id; devices refuse an older version or an expired one")
    signature: str = Field(description="64-byte Ed25519 signature (hex) of the bytes of release")


class Manifest(BaseModel):
    """The bundle's manifest.json (written by ``export``) plus where to fetch each artifact."""

    bundle_id: str = Field(description="sha256 of manifest.json; GET /v1/artifacts/{bundle_id} returns it verbatim")
    job_id: str
    method: str
    artifacts: list[ArtifactRef]
    signature: ManifestSignature = Field(description="what the device stores as manifest.sig next to manifest.json")
    model_config = ConfigDict(extra="allow")


class JoinResponse(BaseModel):
    client_id: str
    token: str = Field(description="bearer token for this client's calls; shown once, stored hashed")
    methods: list[str] = Field(description="methods with a bundle ready now ('none' = plain inference)")
    manifest: Manifest


class GenerateRequest(Strict):
    embedding: list[EmbedValue] = Field(min_length=1, max_length=MAX_EMBED_DIM,
                                        description="the client's set embedding e = g_gamma(D) (only e is "
                                                    "accepted); its length must be the bundle's "
                                                    "hyperparameters.embed_dim")
    bundle_id: str = Field(pattern=r"^[0-9a-f]{64}$",
                           description="the ODPFL-HN bundle whose encoder computed the embedding (sha256 of its "
                                       "manifest.json): its hypernetwork answers, so an embedding is never turned "
                                       "into another release's weights; 404 when it is not served")


class Tensor(BaseModel):
    shape: list[int]
    dtype: Literal["float32"] = "float32"
    data: str = Field(description="base64 of the little-endian float32 values in C order")


class GenerateResponse(BaseModel):
    bundle_id: str
    params: dict[str, Tensor] = Field(description="personalised weights w = f_theta(e), keyed like psi.<name>")


class DLEUpload(Strict):
    freqs: list[DLERow] = Field(min_length=1, max_length=MAX_DLE_DIMS,
                                description="local DLE [D, levels]: per-dimension level frequencies "
                                            "(edge_sdk._btfl.fit_dle); every row has the same length and "
                                            "sums to 1; D and levels must match the other clients' DLEs")
    num_samples: int = Field(ge=1, le=10**9, description="samples the DLE was fitted on (recorded; not a weight: "
                                                          "every client weighs the same in the global DLE)")
    bundle_id: str = Field(pattern=r"^[0-9a-f]{64}$",
                           description="the BTFL bundle whose features the DLE was fitted on (sha256 of its "
                                       "manifest.json): refused with 409 when another BTFL bundle is served, whose "
                                       "clients' DLEs it would be averaged with")


class DLEBase(BaseModel):
    bundle_id: str = Field(description="the served BTFL bundle whose training clients' DLE is in the aggregate")
    clients: int = Field(description="training clients behind that DLE (it counts as that many clients)")


class DLEResponse(BaseModel):
    clients: int = Field(description="clients whose latest uploaded DLE is in the aggregate")
    dims: int
    levels: int
    global_dle: list[list[float]] = Field(description="weighted average of the clients' DLEs and the bundle's: one "
                                                      "source weighs at most FL_SERVE_DLE_SOURCE_SHARE of the "
                                                      "bundle's training clients")
    others_dle: list[list[float]] | None = Field(
        None, description="the same average without the caller's own DLE (what BTFL's authors use); "
                          "null while the caller's is the only one")
    base: DLEBase | None = Field(None, description="the BTFL bundle's training-time DLE, when one is served")


RECIPE_FIELDS = ("method", "rounds", "partition", "alpha", "num_clients")  # a recipe's own, unless a job sets them


class JobRequest(Strict):
    method: str = Field(default_factory=lambda: default_methods()[0], max_length=MAX_METHOD_CHARS,
                        description="a method this coordinator serves (FL_SERVE_METHODS; default: every registered "
                                    "method with a device path); default: the first registered default job's "
                                    "(Algorithm.default_job)")
    dataset: Literal[DATASETS] = "digits"  # type: ignore[valid-type]
    partition: Literal[PARTITIONS] = "pathological"  # type: ignore[valid-type]
    alpha: float | None = Field(None, gt=0, le=1000, description="Dirichlet concentration (partition=dirichlet)")
    rounds: int = Field(30, ge=1, le=1000)
    num_clients: int | None = Field(None, ge=2, le=1000, description="default: the data set's protocol")
    seed: int = Field(0, ge=0, le=2**31 - 1)
    recipe: str | None = Field(None, pattern=RECIPE_NAME,
                               description="FILE or FILE:NAME: a recipe from the operator's recipe directory "
                                           "(FL_SERVE_RECIPES_DIR; no code is accepted over the network); its "
                                           "model and data replace `dataset` (not allowed with it); it trains "
                                           "with its own method, rounds and federation except the fields above "
                                           "that the request sets (listed in the job's spec.overrides)")

    @model_validator(mode="after")
    def _recipe_has_its_data(self) -> "JobRequest":
        if self.recipe is not None and "dataset" in self.model_fields_set:
            raise ValueError("a recipe brings its own data: drop `dataset` or `recipe`")
        return self

    def job_spec(self) -> dict[str, Any]:
        """The job's spec: a built-in recipe's every field; a named recipe's ``recipe``, ``seed``, the fields the
        request set (they replace the recipe's) and ``overrides`` naming them: the rest is the recipe's own."""
        if self.recipe is None:
            return self.model_dump(exclude_none=True)
        given = {k for k in self.model_fields_set & set(RECIPE_FIELDS) if getattr(self, k) is not None}
        return {**self.model_dump(include={"recipe", "seed", *given}), "overrides": sorted(given)}


class RoundRow(BaseModel):
    round: int
    val: float | None = Field(None, description="validation accuracy, a fraction in [0, 1]")
    test: float | None = Field(None, description="new-client accuracy, a fraction; null in a job's rounds (a job "
                                                 "tests its best round only: the job's new_client_accuracy)")
    wall_s: float | None = None


class Job(BaseModel):
    id: str
    status: Literal["queued", "running", "done", "failed", "cancelled"]
    spec: dict[str, Any] = Field(description="the request's fields; a recipe job's: recipe, seed, the fields it "
                                             "set and overrides (their names; the rest is the recipe's own, in "
                                             "its run's run.json)")
    method: str | None = Field(None, description="the method the job trains: its request's, else a recipe job's own "
                                                 "once its run records it (null until then)")
    is_default: bool
    created: float
    started: float | None = None
    finished: float | None = None
    error: str | None = None
    bundle_id: str | None = None
    rounds_done: int = 0
    rounds: list[RoundRow] | None = Field(None, description="the round curve (validation accuracy per round): in "
                                                             "GET /v1/jobs/{id}; null in the job list. "
                                                             "The planned number of rounds is spec.rounds (a "
                                                             "recipe job's own when it does not set it)")
    best_round: int | None = Field(None, description="a finished job's best validation round: its bundle's model")
    new_client_accuracy: float | None = Field(None, description="a finished job's new clients' accuracy at its best "
                                                                "round (a fraction, as rounds[].val): what a device "
                                                                "gets from the job's bundle (BTFL: the received "
                                                                "model's, before a device's labeled "
                                                                "personalisation; safeguard 'rollback': the "
                                                                "received model's, which its devices keep); null "
                                                                "before it is done")
    test_of: Literal["device", "received"] | None = Field(
        None, description="whose new_client_accuracy it is: 'device' (what each device gets from the bundle) or "
                          "'received' (the received model's: a method whose devices personalise on their own "
                          "labels, BTFL; labeled_device_accuracy is a device's)")
    labeled_device_accuracy: float | None = Field(
        None, description="where test_of is 'received': what a device gets after personalising on a labeled random "
                          "half of each new client's samples, scored on the other half (a fraction; the bundle's "
                          "training DLE); null for other jobs, and where the run's samples could not be rebuilt")
    safeguard: str | None = Field(None, description="a finished job's safeguard rule, the one its bundle's devices "
                                                    "apply after personalising (edge_sdk.safeguard): 'rollback' "
                                                    "keeps the received model on every device; null before it is "
                                                    "done or for a method that declares none")
    warning: str | None = Field(None, description="a finished job whose new-client predictions collapsed to one "
                                                  "class or sit at chance: one line saying so (its bundle is served "
                                                  "all the same); null otherwise")


class Health(BaseModel):
    status: Literal["ok", "degraded"] = Field("ok", description="degraded: some method cannot be served, or the "
                                                                "store's disk is full; the others keep serving")
    bundles: int
    jobs: dict[str, int]
    signing_key: str = Field(description="Ed25519 public key (hex) that signs every manifest; pin it on devices")
    degraded: dict[str, str] = Field(default_factory=dict, description="method (or 'disk') -> what is wrong")
    quarantined: list[str] = Field(default_factory=list, description="objects (sha256) that failed their "
                                                                     "integrity check, moved to objects/quarantine")


class SigningKey(BaseModel):
    alg: Literal["Ed25519"] = "Ed25519"
    public_key: str = Field(description="32-byte Ed25519 public key, hex; signs the exact bytes of manifest.json")

