"""Who is calling: API keys, the tenant each belongs to, and what each may do.

One key (`--api-key`, vLLM's flag) or many (`--api-keys-file`, JSON or YAML): a list of
`{key | key_sha256, tenant, models, priority, rpm, tpm, max_concurrent, admin}`. Keys are held only as SHA-256
digests, so a key in the file may be given as its digest and a memory dump shows no key. A presented key is
hashed and looked up (the digest is the dictionary key, so the lookup leaks nothing about other keys' bytes).
`--api-key` alone is one admin key of tenant "default" with no limits. The file is re-read on SIGHUP; a file that
no longer parses keeps the keys in force and logs why.

What a key grants (`Principal`):
- `models`: the names it may ask for (served names or adapter names; shell-style patterns, `tenant-a-*`);
  absent: all. Another model is a 403.
- `admin`: loading and unloading adapters (the admin routes); others get 403.
- `priority`: its admission band; higher is admitted first under pressure, negative is sheddable (llm-d's bands).
- `rpm`, `tpm`: requests and tokens per minute, enforced fleet-wide (gateway.ratelimit).
- `max_concurrent`: generations in progress at once on each gateway (429 past it): what bounds the share of the
  nodes' batch a key can take, which a rate alone does not.
- `tenant`: whose traffic it is: admission shares the gateway fairly among tenants, and each tenant's prompts hash
  into KV blocks of their own (its name salts the block hashes), so no tenant can learn from cache timing what
  another one sent.

The principal of the request being served is in `current_principal` (a context variable: set by the HTTP
middleware and the gRPC servicer, read by admission and the model checks of both APIs).
"""

from __future__ import annotations

import contextvars
import fnmatch
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from kvrelay.gateway.errors import Forbidden, Unauthorized

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
_FIELDS = {"key", "key_sha256", "tenant", "models", "priority", "rpm", "tpm", "max_concurrent", "admin", "name"}


@dataclass(frozen=True)
class Principal:
    """What one API key may do. `key_id`: a short, non-secret name for the key (logs, rate-limit buckets)."""

    key_id: str
    tenant: str = DEFAULT_TENANT
    models: tuple[str, ...] | None = None  # None: every model
    priority: int = 0
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    admin: bool = False

    def may_use(self, model: str) -> bool:
        return self.models is None or any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


current_principal: contextvars.ContextVar[Principal | None] = contextvars.ContextVar("kvrelay_principal",
                                                                                      default=None)


def digest(key: str | bytes) -> str:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


class KeysFileError(ValueError):
    """--api-keys-file does not hold a valid list of keys; the message says which entry and why."""


def parse_keys(text: str, source: str = "api keys") -> dict[str, Principal]:
    """{sha256 hex of the key: what it grants} from the file's JSON or YAML text."""
    try:
        data = json.loads(text)
    except ValueError:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise KeysFileError(f"{source}: neither JSON nor YAML: {e}") from None
    if isinstance(data, dict) and "keys" in data:
        data = data["keys"]
    if not isinstance(data, list) or not data:
        raise KeysFileError(f"{source}: expected a non-empty list of keys (or {{keys: [...]}})")
    keys: dict[str, Principal] = {}
    for i, entry in enumerate(data):
        where = f"{source}: entry {i}"
        if not isinstance(entry, dict):
            raise KeysFileError(f"{where}: expected a mapping, got {type(entry).__name__}")
        unknown = set(entry) - _FIELDS
        if unknown:
            raise KeysFileError(f"{where}: unknown fields {sorted(unknown)} (known: {sorted(_FIELDS)})")
        hexdigest = _entry_digest(entry, where)
        if hexdigest in keys:
            raise KeysFileError(f"{where}: the same key appears twice")
        keys[hexdigest] = _principal(entry, hexdigest, where)
    return keys


def _entry_digest(entry: dict, where: str) -> str:
    if ("key" in entry) == ("key_sha256" in entry):
        raise KeysFileError(f"{where}: give exactly one of 'key' and 'key_sha256'")
    if "key" in entry:
        key = entry["key"]
        if not isinstance(key, str) or len(key) < 8:
            raise KeysFileError(f"{where}: 'key' must be a string of at least 8 characters")
        return digest(key)
    value = entry["key_sha256"]
    if not isinstance(value, str) or len(value) != 64 or any(c not in "0123456789abcdefABCDEF" for c in value):
        raise KeysFileError(f"{where}: 'key_sha256' must be 64 hex digits (sha256sum of the key)")
    return value.lower()


def _principal(entry: dict, hexdigest: str, where: str) -> Principal:
    tenant = entry.get("tenant", DEFAULT_TENANT)
    if not isinstance(tenant, str) or not tenant or not tenant.isprintable():
        raise KeysFileError(f"{where}: 'tenant' must be a non-empty printable string")
    models = entry.get("models")
    if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) and m for m in models)):
        raise KeysFileError(f"{where}: 'models' must be a list of model names")
    limits = {}
    for name in ("rpm", "tpm", "max_concurrent"):
        value = entry.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise KeysFileError(f"{where}: '{name}' must be a positive integer (absent: no limit)")
        limits[name] = value
    priority = entry.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
        raise KeysFileError(f"{where}: 'priority' must be an integer from -1000 to 1000 (negative: sheddable)")
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise KeysFileError(f"{where}: 'admin' must be true or false")
    name = entry.get("name") or f"{tenant}:{hexdigest[:8]}"
    return Principal(key_id=str(name), tenant=tenant, models=tuple(models) if models is not None else None,
                     priority=priority, rpm=limits["rpm"], tpm=limits["tpm"],
                     max_concurrent=limits["max_concurrent"], admin=admin)


class KeyStore:
    """The keys in force. Empty (no --api-key, no --api-keys-file): the API is open and every request is the
    anonymous principal of tenant "default"."""

    ANONYMOUS = Principal(key_id="anonymous", admin=True)

    def __init__(self, api_key: str | None = None, keys_file: str | None = None) -> None:
        self.keys_file = Path(keys_file) if keys_file else None
        self._single: dict[str, Principal] = {}
        if api_key:
            self._single[digest(api_key)] = Principal(key_id="api-key", admin=True)
        self._keys: dict[str, Principal] = {**self._single, **self._read_file()}

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def tenants(self) -> set[str]:
        return {p.tenant for p in self._keys.values()}

    def _read_file(self) -> dict[str, Principal]:
        if self.keys_file is None:
            return {}
        try:
            text = self.keys_file.read_text()
        except OSError as e:
            raise KeysFileError(f"--api-keys-file {self.keys_file}: {e.strerror or e}") from None
        return parse_keys(text, f"--api-keys-file {self.keys_file}")

    def reload(self) -> bool:
        """Re-read the keys file (SIGHUP). On an error the keys in force stay, and it is logged."""
        try:
            keys = {**self._single, **self._read_file()}
        except KeysFileError as e:
            logger.error("keys not reloaded, the previous %d stay in force: %s", len(self._keys), e)
            return False
        self._keys = keys
        logger.info("API keys reloaded: %d keys, %d tenants", len(keys), len(self.tenants()))
        return True

    def authenticate(self, authorization: str | bytes | None) -> Principal:
        """The principal of an 'Authorization: Bearer <key>' header value; Unauthorized without a valid key."""
        if not self._keys:
            return self.ANONYMOUS
        raw = authorization.decode("latin-1") if isinstance(authorization, bytes) else (authorization or "")
        scheme, _, token = raw.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthorized("Missing API key; send it as 'Authorization: Bearer <key>'")
        principal = self._keys.get(digest(token))
        if principal is None:
            raise Unauthorized("Incorrect API key provided")
        return principal


def check_model(principal: Principal | None, model: str) -> None:
    """403 unless the principal may use `model` (a served name or an adapter's name)."""
    if principal is not None and not principal.may_use(model):
        raise Forbidden(f"This API key may not use the model `{model}`.", param="model", code="model_not_allowed")


def check_admin(principal: Principal | None) -> None:
    if principal is not None and not principal.admin:
        raise Forbidden("This route needs an admin API key ('admin: true' in --api-keys-file).",
                        code="admin_key_required")
