"""The models one gateway serves: several base models, each under its served names, and the LoRA adapters on them.

Each base model is a `ModelEndpoint`: its tokenizer, its block index (keys namespaced by the model), a router over
its nodes only (`ModelView`, discovery as that router sees it), a dispatcher, and the chat, completions and
tokenize endpoints. What the whole gateway shares (discovery, node clients, liveness, metrics, admission and
shutdown) is built once, by runtime.Gateway.

A request's `model` resolves (`ServedModels.resolve`) to a base model by one of its served names (its id unless
--served-model-name gives aliases) or to a LoRA adapter by its name (gateway.adapters), which runs on its base
model's nodes; anything else is a 404 with OpenAI's `model_not_found`. No `model` means the first model, as in
vLLM. `/v1/models` lists both, with vLLM's fields: `root` (the model's id, an adapter's path) and `parent` (an
adapter's base model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvrelay.gateway.adapters import Adapters
from kvrelay.gateway.discovery import Discovery, DiscoveryConfig, Node
from kvrelay.gateway.errors import BadRequest, ModelNotFound


class ModelView:
    """Discovery as one model's router sees it: that model's nodes only."""

    def __init__(self, discovery: Discovery, model_id: str) -> None:
        self.discovery = discovery
        self.model_id = model_id
        self.config: DiscoveryConfig = replace(discovery.config, model_id=model_id, other_models=())

    @property
    def registry_error(self) -> str | None:
        return self.discovery.registry_error

    def routable(self, role: str) -> list[Node]:
        return self.discovery.routable(role, self.model_id)

    def nodes(self) -> list[Node]:
        return self.discovery.nodes(self.model_id)

    def max_model_len(self) -> int | None:
        """The smallest context any of the model's routable nodes accepts."""
        return self.discovery.max_model_len(self.model_id)

    def vocab_size(self) -> int | None:
        return self.discovery.vocab_size(self.model_id)


@dataclass
class ModelEndpoint:
    """One base model behind the gateway (built by runtime.Gateway)."""

    model_id: str
    path: str  # its folder: tokenizer, config
    names: tuple[str, ...]  # what `model` may say for it
    tokenizer: object
    index: object | None
    router: object
    dispatcher: object
    core: object  # gateway.core.GatewayCore
    chat: object
    completions: object
    tokenize: object
    embeddings: object  # gateway.serving_embeddings.EmbeddingServing
    images: object  # gateway.images.ChatImages


@dataclass(frozen=True)
class Target:
    """Where a request goes: the name it used (echoed back), its base model, and its adapter ("": none)."""

    name: str
    endpoint: ModelEndpoint
    lora_name: str = ""


def assign_names(model_ids: Sequence[str], specs: Sequence[str], served: Sequence[str]) -> list[tuple[str, ...]]:
    """Each model's served names. `served` entries are NAME (the first model's) or NAME=MODEL, MODEL being one of
    `specs` (as given to --model) or of `model_ids`; a model named nowhere is served under its id."""
    names: list[list[str]] = [[] for _ in model_ids]
    for entry in served:
        name, sep, model = entry.partition("=")
        index = 0
        if sep:
            matches = [i for i, (spec, mid) in enumerate(zip(specs, model_ids)) if model in (spec, mid)]
            if not matches:
                raise ValueError(f"served_model_name: {entry!r} names model {model!r}, which is not served here "
                                 f"(models: {', '.join(model_ids)})")
            index = matches[0]
        if not name:
            raise ValueError(f"served_model_name: {entry!r} has no name")
        names[index].append(name)
    out = [tuple(dict.fromkeys(n)) or (mid,) for n, mid in zip(names, model_ids)]
    seen: dict[str, str] = {}
    for mid, model_names in zip(model_ids, out):
        for name in model_names:
            if seen.setdefault(name, mid) != mid:
                raise ValueError(f"served_model_name: {name!r} would name both {seen[name]} and {mid}")
    return out


class ServedModels:
    """The base models (first: the default) and the adapters on them."""

    def __init__(self, endpoints: list[ModelEndpoint], adapters: Adapters) -> None:
        if not endpoints:
            raise ValueError("a gateway serves at least one model")
        self.endpoints = endpoints
        self.adapters = adapters
        self._by_name = {name: ep for ep in endpoints for name in ep.names}
        self._by_id = {ep.model_id: ep for ep in endpoints}

    @property
    def default(self) -> ModelEndpoint:
        return self.endpoints[0]

    def names(self) -> list[str]:
        return [name for ep in self.endpoints for name in ep.names]

    def resolve(self, name: str | None) -> Target:
        if not name:
            return Target(self.default.names[0], self.default)
        endpoint = self._by_name.get(name)
        if endpoint is not None:
            return Target(name, endpoint)
        record = self.adapters.get(name)
        if record is not None and record.model_id in self._by_id:
            return Target(name, self._by_id[record.model_id], lora_name=name)
        raise ModelNotFound(f"The model `{name}` does not exist.", param="model")

    def base_model_id(self, name: str) -> str:
        """The id of the base model served as `name` (a served name or an id); 400 otherwise."""
        endpoint = self._by_name.get(name) or self._by_id.get(name)
        if endpoint is None:
            raise BadRequest(f"base_model_name: {name!r} is not a model served here", param="base_model_name")
        return endpoint.model_id

    def cards(self) -> list[dict]:
        """/v1/models' entries: each base model under each name, then each adapter, with vLLM's root and parent."""
        cards = []
        for ep in self.endpoints:
            max_len = ep.core.max_model_len
            cards += [dict(id=name, root=ep.model_id, parent=None, max_model_len=max_len) for name in ep.names]
        for record in self.adapters.served():
            endpoint = self._by_id.get(record.model_id)
            if endpoint is not None:
                cards.append(dict(id=record.name, root=record.path or record.name, parent=endpoint.names[0],
                                  max_model_len=endpoint.core.max_model_len))
        return cards
