"""Chat templates rendered as transformers renders them, without transformers: ``render_chat_template`` (a
sandboxed, immutable Jinja environment with transformers' globals and filters, ``{% generation %}`` blocks, the
reasoning-field aliases), and ``template_supports_tools``. jinja2 only; no torch."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any


def render_chat_template(
    template: str,
    messages: list,
    tools: list | None = None,
    documents: list | None = None,
    add_generation_prompt: bool = False,
    **variables: Any,
) -> str:
    """``template`` rendered over ``messages``: transformers' ``render_jinja_template`` for one conversation."""
    messages = _normalize_messages(messages)
    if tools is not None:
        for tool in tools:
            if not isinstance(tool, dict):
                raise ValueError("Tools should be JSON schemas (dicts); functions need transformers to convert them")
    if documents is not None:
        for document in documents:
            if not isinstance(document, dict):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = _plain(messages)
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
    return _compiled(template).render(
        messages=_alias_reasoning_fields(chat),
        tools=_plain(tools),
        documents=_plain(documents),
        add_generation_prompt=add_generation_prompt,
        **_plain(variables),
    )


def _message_dicts(value: Any) -> Any:
    """Message objects (dataclasses, pydantic models) as dicts, all the way down."""
    if isinstance(value, Mapping):
        return {k: _message_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_message_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_message_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _message_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _message_dicts(value.model_dump())
    return value


def _normalize_messages(conversation: Any) -> list[dict]:
    """Messages as dicts without the keys whose value is None (``content=None`` next to ``tool_calls``)."""
    normalized = []
    for message in _message_dicts(getattr(conversation, "messages", conversation)):
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        normalized.append({k: v for k, v in message.items() if v is not None})
    return normalized


def _plain(value: Any) -> Any:
    """What a template may see: plain JSON-like types (subclasses stripped to their base type), anything else an
    inert ``"<TypeName>"`` placeholder (transformers' ``_plain_template_data``)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if type(value).__module__ == "numpy" and type(value).__name__ != "ndarray" and hasattr(value, "item"):
        return _plain(value.item())  # a numpy scalar (np.bool_(False) must stay falsy)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning_fields(chat: list[dict]) -> list[dict]:
    """A message's reasoning under every name templates read it by (``reasoning_content``, and ``thinking``)."""
    aliased = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


@lru_cache(maxsize=16)
def _compiled(template: str):
    """The template compiled in transformers' chat environment (cached per template text)."""
    return _chat_environment().from_string(template)


@lru_cache(maxsize=1)
def _chat_environment():
    """transformers' chat-template environment: sandboxed and immutable, trim_blocks and lstrip_blocks, loop
    controls, ``{% generation %}`` blocks (rendered as their body), a ``tojson`` that does not escape HTML,
    ``raise_exception``, ``strftime_now``, and ``dict`` / ``namespace`` that refuse underscore names."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks assistant spans with it; rendering
        text needs only the body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # Jinja's own signature trick, so that namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                    "Please rename the attribute."
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def template_supports_tools(template: str) -> bool:
    """Whether a Jinja chat template reads the ``tools`` variable (otherwise the tools never reach the model)."""
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False
