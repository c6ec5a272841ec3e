"""text.tokenizer.TextTokenizer against transformers' AutoTokenizer (the reference) on the test checkpoints (GPT-2 and
Llama), SmolLM2's converted tokenizer when its GGUF is on this machine, and small hand-made tokenizer directories
that exercise what transformers does at load (special tokens added, a missing post-processor, legacy files,
named templates, WordPiece clean-up); and that the torch-free path imports neither torch nor transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

transformers = pytest.importorskip("transformers")  # the reference; TextTokenizer itself never imports it
jinja2 = pytest.importorskip("jinja2")

from text.tokenizer import TextTokenizer, clean_up_tokenization, write_tokenizer_dir  # noqa: E402

from conftest import ROOT  # noqa: E402

CORPUS = [
    "",
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nand\r\nCRLF",
    "                                        a run of spaces",
    "café naïve résumé über — “quotes” ‘apostrophes’",
    "東京 北京 서울 Ελληνικά русский العربية עברית हिन्दी",
    "emoji 😀🚀👩‍👩‍👧‍👦 🇫🇷 and a lone surrogate-free astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "<|endoftext|>",
    "before<|endoftext|>after <|endoftext|> spaced",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<pad><pad> <pad>",
    "<|endoftext|",
    "|endoftext|>",
    "<|im_start",
    "def fibonacci(n):\n    a, b = 0, 1\n    return a\n",
    "Numbers: 0 1 2 3 4 5 3.14159 1e-9 0xFF 1,000,000",
    "It's n't they 're we 've I 'm , . ! ?",
    'json: {"a": [1, 2, {"b": null}], "c": "\\u00e9"}',
    "\x00\x01 control \x7f chars \u200b zero width \ufeff bom",
    " ".join(f"word{i}" for i in range(600)),
    "Once upon a time, in a small village by the sea, there lived an old fisherman. " * 30,
]

ATTRIBUTES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
    "bos_token_id",
    "eos_token_id",
    "unk_token_id",
    "pad_token_id",
    "all_special_tokens",
    "all_special_ids",
    "special_tokens_map",
    "vocab_size",
    "chat_template",
)


# --- tokenizer directories ---------------------------------------------------------------------------------------
def _smollm2_meta_dir() -> str | None:
    """SmolLM2's converted tokenizer directory, when its GGUF is already on this machine (repo-local test cache or
    the user cache); None otherwise: nothing is fetched here (test_llama.py fetches it)."""
    from models.cache_dir import cache_root
    from models.loading import ALIASES, convert, fetch

    name = ALIASES["smollm2"].filename
    for root in (os.path.join(ROOT, "weights", "cache"), cache_root()):
        path = os.path.join(root, "gguf", name)
        if fetch.is_present(path):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("MINIBATCH_CACHE", root)
                return convert.gguf_metadata_dir(path)
    return None


@pytest.fixture(scope="module")
def llama_tok_dir(tmp_path_factory) -> str:
    from scripts.make_test_model import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("tt_llama")), arch="llama", seed=2)


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    found = _smollm2_meta_dir()
    if found is None:
        pytest.skip("SmolLM2's GGUF is not on this machine (python scripts/fetch_smollm2.py fetches it)")
    return found


@pytest.fixture(scope="module", params=["gpt2", "gpt2_pad", "llama", "smollm2"])
def tok_dir(request) -> str:
    fixture = {"gpt2": "tiny_model_dir", "gpt2_pad": "tiny_pad_model_dir", "llama": "llama_tok_dir"}
    return request.getfixturevalue(fixture.get(request.param, "smollm2_dir"))


@pytest.fixture(scope="module")
def pair(tok_dir):
    """(HF reference, TextTokenizer) on one directory."""
    return transformers.AutoTokenizer.from_pretrained(tok_dir), TextTokenizer.from_dir(tok_dir)


def assert_same_tokenizer(hf, ours, corpus=CORPUS) -> None:
    """encode (with and without special tokens), decode (with and without skipping special tokens, also of ids
    that hold special tokens), the special tokens, sizes and the Rust pipeline all equal HF's."""
    for attr in ATTRIBUTES:
        assert getattr(ours, attr) == getattr(hf, attr), attr
    assert len(ours) == len(hf)
    assert ours.backend_tokenizer.to_str() == hf.backend_tokenizer.to_str()
    specials = [i for i in hf.all_special_ids if i is not None]
    for text in corpus:
        for add in (True, False):
            ids = hf.encode(text, add_special_tokens=add)
            assert ours.encode(text, add_special_tokens=add) == ids, (text[:60], add)
        mixed = specials + ids + specials[:1] + ids[:3]  # special tokens in front, inside and at the end
        for skip in (True, False):
            for seq in (ids, mixed):
                assert ours.decode(seq, skip_special_tokens=skip) == hf.decode(seq, skip_special_tokens=skip)


# --- encode / decode / special tokens ------------------------------------------------------------------------------
def test_matches_hf_on_the_checkpoints(pair):
    hf, ours = pair
    assert type(hf).__name__ == "TokenizersBackend"  # the class these directories name (from_dir's domain)
    assert_same_tokenizer(hf, ours)
    assert ours.encode("<|endoftext|>", add_special_tokens=False) == [hf.convert_tokens_to_ids("<|endoftext|>")]


def test_decode_is_prefix_stable_at_character_boundaries(pair):
    """text/detokenizer.py's contract: decode(ids + more) starts with decode(ids) where ids end on a character."""
    _, ours = pair
    ids = ours.encode("café 東京 😀 hello world <|endoftext|> again", add_special_tokens=False)
    whole = ours.decode(ids)
    for n in range(len(ids) + 1):
        head = ours.decode(ids[:n])
        if not head.endswith("\ufffd"):
            assert whole.startswith(head), n


def test_defaults_and_inputs(pair):
    hf, ours = pair
    ids = ours.encode("hi <|endoftext|> there")
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)  # the engine's call: skipping is the default
    assert ours.decode(ids[0]) == hf.decode(ids[0])  # one id
    assert ours.decode(tuple(ids), skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    with pytest.raises(ValueError):
        ours.encode(123)


# --- chat templates ------------------------------------------------------------------------------------------------
MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France? 🇫🇷"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Japan (東京)?"},
]
NO_SYSTEM = [{"role": "user", "content": "hi"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city, «today»",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,  # dropped before rendering (transformers drops keys whose value is None)
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": '{"temp": 21}', "name": "get_weather"},
    {"role": "assistant", "content": "21 degrees.", "reasoning": "read the tool's answer"},
    {"role": "user", "content": "Thanks"},
]

# A template that uses what transformers' environment adds or configures: trim_blocks/lstrip_blocks, loop
# controls, namespace, dict, tojson's options (non-ASCII kept, indent, separators, sort_keys), {% generation %},
# the special-token variables, a missing key (content dropped because None), reasoning aliases and strftime_now.
FEATURES_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(n=0, last='') %}
{% for m in messages %}
    {% if m.role == 'tool' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    <{{ m.role }}>{% if m.content is defined %}{{ m.content }}{% else %}[no content]{% endif %}
    {% if m.tool_calls %}{{ m.tool_calls | tojson(indent=2, sort_keys=True) }}{% endif %}
    {% if m.reasoning_content %}(thought: {{ m.reasoning_content }} / {{ m.thinking }}){% endif %}
    {% if loop.index > 8 %}{% break %}{% endif %}
{% endfor %}
{% if tools %}{{ tools | tojson(separators=(',', ':')) }}{{ dict(a=1, b=[2]) | tojson }}{% endif %}
{% generation %}turns={{ ns.n }}{% endgeneration %} year={{ strftime_now('%Y')[:2] }}
{%- if add_generation_prompt %}<assistant>{{ eos_token }}{% endif %}"""

CHATML_TEMPLATE = """{% for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

ROLE_CHECK_TEMPLATE = """{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}\
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}\
{{ m.content }}{% endfor %}"""

BROKEN_TEMPLATES = [
    ROLE_CHECK_TEMPLATE,  # raise_exception -> TemplateError
    "{% for m in messages %}{{ m.content }",  # syntax error
    "{{ messages[0].content.upper() }}{{ messages.append(1) }}",  # the immutable sandbox refuses mutation
    "{% set ns = namespace() %}{% set ns._hidden = 1 %}",  # transformers' namespace refuses underscore names
    "{{ messages[0].__class__.__mro__ }}",  # the sandbox refuses dunder access
    "{{ undefined_thing.attr }}",  # UndefinedError
    "{{ 1 / 0 }}",  # ZeroDivisionError from inside the template
]


def hf_render(hf, messages, **kwargs) -> str:
    kwargs.setdefault("add_generation_prompt", True)
    return hf.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("template", [CHATML_TEMPLATE, FEATURES_TEMPLATE], ids=["chatml", "features"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_passed_templates_render_like_hf(pair, template, generation_prompt):
    """A CHAT_TEMPLATE-style template passed as ``chat_template=``: multi-turn with a system turn, tools and
    tool calls, with and without the generation prompt."""
    hf, ours = pair
    for messages, tools in ((MULTI_TURN, None), (NO_SYSTEM, None), (TOOL_TURNS, TOOLS), (MULTI_TURN, TOOLS)):
        expected = hf_render(hf, messages, tools=tools, chat_template=template, add_generation_prompt=generation_prompt)
        got = ours.apply_chat_template(
            messages, tools=tools, chat_template=template, add_generation_prompt=generation_prompt
        )
        assert got == expected
    tokens = ours.apply_chat_template(MULTI_TURN, chat_template=template, tokenize=True)
    assert tokens == hf.apply_chat_template(
        MULTI_TURN, chat_template=template, add_generation_prompt=True, return_dict=False
    )


def test_features_template_is_not_vacuous(pair):
    _, ours = pair
    text = ours.apply_chat_template(TOOL_TURNS, tools=TOOLS, chat_template=FEATURES_TEMPLATE)
    assert '"city": "Paris"' in text and "[no content]" in text and "«today»" in text  # tojson keeps non-ASCII
    assert "turns=4" in text and "(thought: read the tool's answer / read the tool's answer)" in text
    assert '{"a": 1, "b": [2]}' in text and "\n    <" not in text  # lstrip_blocks / trim_blocks at work


def test_own_template_renders_like_hf(pair):
    hf, ours = pair
    assert ours.chat_template == hf.chat_template
    if hf.chat_template is None:
        with pytest.raises(ValueError):
            ours.apply_chat_template(MULTI_TURN)
        return
    for messages in (MULTI_TURN, NO_SYSTEM, TOOL_TURNS):
        for generation_prompt in (True, False):
            # SmolLM2's own template fails on a tool-call turn without content: both must raise alike then
            assert_same_render(hf, ours, messages, tools=TOOLS, add_generation_prompt=generation_prompt)


def test_smollm2_template(smollm2_dir):
    hf, ours = transformers.AutoTokenizer.from_pretrained(smollm2_dir), TextTokenizer.from_dir(smollm2_dir)
    text = ours.apply_chat_template(NO_SYSTEM)
    assert text == hf_render(hf, NO_SYSTEM)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert ours.encode(text, add_special_tokens=False)[0] == ours.convert_tokens_to_ids("<|im_start|>")


@pytest.mark.parametrize("template", BROKEN_TEMPLATES)
def test_template_errors_raise_like_hf(pair, template):
    """The same exception class and message as transformers (the engine turns any Exception into a 400)."""
    hf, ours = pair
    messages = [{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}]
    with pytest.raises(Exception) as expected:
        hf_render(hf, messages, chat_template=template)
    with pytest.raises(Exception) as got:
        ours.apply_chat_template(messages, chat_template=template)
    assert type(got.value) is type(expected.value) and str(got.value) == str(expected.value)


def test_template_data_is_plain_like_hf(pair):
    """What a template sees is plain data: numpy scalars as Python values (np.bool_(False) stays falsy), str and
    int subclasses as str and int, dataclasses as dicts, any other object as a "<TypeName>" placeholder."""
    import dataclasses
    import enum

    import numpy as np

    class Color(str, enum.Enum):
        RED = "red"

    @dataclasses.dataclass
    class Call:
        name: str
        n: int

    class Opaque:
        pass

    template = (
        "{% for m in messages %}{{ m.n }} {{ 'T' if m.flag else 'F' }} {{ m.color }} {{ m.call }} {{ m.obj }} "
        "{{ m.pair | tojson }} {{ extra }}|{% endfor %}"
    )
    message = {"role": "user", "content": "x", "n": np.int64(3), "flag": np.bool_(False), "color": Color.RED}
    messages = [{**message, "call": Call("f", 1), "obj": Opaque(), "pair": (np.float32(0.5), None)}]
    kwargs = {"chat_template": template, "extra": [np.int8(1), Opaque()]}
    assert_same_render(hf := pair[0], pair[1], messages, **kwargs)
    assert hf_render(hf, messages, **kwargs) == "3 F red {'name': 'f', 'n': 1} <Opaque> [0.5, null] [1, '<Opaque>']|"


def test_bad_conversations_raise_like_hf(pair):
    hf, ours = pair
    for messages in ([], ["not a dict"], [{"role": "user", "content": "x"}, 3]):
        with pytest.raises(Exception) as expected:
            hf_render(hf, messages, chat_template=CHATML_TEMPLATE)
        with pytest.raises(type(expected.value)):
            ours.apply_chat_template(messages, chat_template=CHATML_TEMPLATE)


# --- what transformers does at load, on hand-made directories ------------------------------------------------------
def _write(directory, name: str, content) -> None:
    os.makedirs(os.path.dirname(os.path.join(directory, name)), exist_ok=True)
    with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
        f.write(content if isinstance(content, str) else json.dumps(content))


def _wordpiece_dir(directory) -> str:
    """A BERT-style WordPiece tokenizer (normalizer, [CLS]/[SEP] post-processor, [MASK] missing from the
    vocabulary) with clean_up_tokenization_spaces on and a chat template inside the config."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    words = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "hello", "world", ",", ".", "!", "?", "'", "s", "it", "don", "t", "a"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(cleanup=False)  # the clean-up is left to the config's flag
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 1), ("[SEP]", 2)]
    )
    tok.add_special_tokens(["[UNK]", "[CLS]", "[SEP]", "[PAD]"])
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "TokenizersBackend",
        "clean_up_tokenization_spaces": True,
        **{f"{k}_token": f"[{k.upper()}]" for k in ("unk", "cls", "sep", "pad", "mask")},
        "chat_template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    }
    _write(directory, "tokenizer_config.json", config)
    return str(directory)


def _bpe_variant_dir(directory, source: str, kind: str) -> str:
    """The test checkpoint's BPE with what transformers fixes up at load: ``no_post`` (no post-processor, an
    add_bos_token that a tokenizer.json makes transformers ignore, special tokens missing from the vocabulary as
    strings and as saved AddedTokens, a model-specific ``image_token``, extra special tokens, named templates in the
    config); ``legacy`` (transformers 4's special_tokens_map.json and added_tokens.json, template files,
    split_special_tokens)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(source, "tokenizer.json"))
    os.makedirs(directory, exist_ok=True)
    if kind == "no_post":
        tok.post_processor = None
        eot = {"__type": "AddedToken", "content": "<eot>", "lstrip": False, "rstrip": True, "normalized": False}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": True,
            "bos_token": "Th",  # a vocabulary entry that becomes an added special token
            "eos_token": {**eot, "single_word": False, "special": True},
            "image_token": "<image>",
            "extra_special_tokens": ["<x1>", "<|endoftext|>"],
            "chat_template": [
                {"name": "default", "template": "D{{ bos_token }}{{ image_token }}{{ messages[0].content }}"},
                {"name": "tool_use", "template": "T{{ tools | tojson }}"},
            ],
        }
    else:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>"}
        config["split_special_tokens"] = True  # special tokens written in the text encode as plain text
        config["additional_special_tokens"] = ["<a1>"]
        special_map = {"eos_token": {"content": "<e>", "lstrip": False, "rstrip": False, "normalized": False}}
        _write(directory, "special_tokens_map.json", {**special_map, "additional_special_tokens": ["<a2>"]})
        _write(directory, "added_tokens.json", {"<added>": tok.get_vocab_size() + 5})
        _write(directory, "chat_template.jinja", "main {{ eos_token }}{{ messages[0].content }}")
        _write(directory, "additional_chat_templates/rag.jinja", "rag {{ documents | tojson }}")
    tok.save(os.path.join(directory, "tokenizer.json"))
    _write(directory, "tokenizer_config.json", config)
    return str(directory)


@pytest.fixture(scope="module", params=["wordpiece", "no_post", "legacy"])
def made_dir(request, tmp_path_factory, tiny_model_dir) -> str:
    directory = tmp_path_factory.mktemp(f"tt_{request.param}")
    if request.param == "wordpiece":
        return _wordpiece_dir(directory)
    return _bpe_variant_dir(directory, tiny_model_dir, request.param)


def test_load_time_fixups_match_hf(made_dir):
    hf, ours = transformers.AutoTokenizer.from_pretrained(made_dir), TextTokenizer.from_dir(made_dir)
    corpus = CORPUS + ["Hello, world! It's don't ?", "<image><x1>Th<eot> x <added><a1><a2><e>", "[MASK] a [SEP]"]
    assert_same_tokenizer(hf, ours, corpus)
    options = [None, "{{ image_token | default('none') }}{{ mask_token }}{{ messages | length }}"]
    if isinstance(hf.chat_template, dict):
        options += sorted(hf.chat_template)  # a named template
    for chat_template in options:
        for tools in (None, TOOLS):  # tools pick a "tool_use" template among several
            kwargs = {"chat_template": chat_template, "tools": tools, "documents": [{"title": "t", "text": "é"}]}
            assert_same_render(hf, ours, MULTI_TURN, **kwargs)


def assert_same_render(hf, ours, messages, **kwargs) -> None:
    """Both render the same text, or both raise the same exception class."""
    try:
        expected = hf_render(hf, messages, **kwargs)
    except Exception as exc:
        with pytest.raises(type(exc)):
            ours.apply_chat_template(messages, **kwargs)
        return
    assert ours.apply_chat_template(messages, **kwargs) == expected


def test_wordpiece_clean_up_is_applied(tmp_path):
    """Not vacuous: the config's clean_up_tokenization_spaces changes a WordPiece decode (not a BPE one)."""
    ours = TextTokenizer.from_dir(_wordpiece_dir(tmp_path))
    ids = ours.encode("hello, world!")
    raw = ours.backend_tokenizer.decode(ids)
    assert raw == "hello , world !" and ours.decode(ids) == clean_up_tokenization(raw) == "hello, world!"


def test_model_specific_class_is_refused_and_write_tokenizer_dir_converts_it(tmp_path, tiny_model_dir):
    """A directory naming a class that transformers rebuilds in Python is refused clearly; write_tokenizer_dir
    saves the loaded tokenizer as the generic class, which reads back equal to the original (HF and ours)."""
    src = tmp_path / "gpt2cls"
    hf = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    hf.save_pretrained(src)
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    with pytest.raises(ValueError, match="write_tokenizer_dir"):
        TextTokenizer.from_dir(str(src))
    original = transformers.AutoTokenizer.from_pretrained(str(src))
    assert type(original).__name__ == "GPT2Tokenizer"
    out = write_tokenizer_dir(original, str(tmp_path / "generic"))
    assert_same_tokenizer(original, TextTokenizer.from_dir(out))
    assert_same_tokenizer(original, transformers.AutoTokenizer.from_pretrained(out))


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        TextTokenizer.from_dir(str(tmp_path))


# --- the torch-free path -------------------------------------------------------------------------------------------
TORCH_FREE = textwrap.dedent(
    """
    import ctypes, sys

    from guided import grammars as structured_output
    from text import tokenizer as text_tokenizer

    tok = text_tokenizer.TextTokenizer.from_dir(sys.argv[1])
    ids = tok.encode("hello world <|endoftext|>")
    assert tok.decode(ids, skip_special_tokens=False) == "hello world <|endoftext|>", tok.decode(ids)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="<{{ messages[0].content }}>")
    assert text == "<hi>", text
    compiler = structured_output.GrammarCompiler(tok, len(tok), {tok.eos_token_id})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    state = compiler.matcher(structured_output.schema_grammar(schema))
    words = (len(tok) + 31) // 32
    mask = (ctypes.c_int32 * words)()
    state.fill_mask(ctypes.addressof(mask), 4 * words)
    allowed = [t for t in range(len(tok)) if mask[t // 32] >> (t % 32) & 1]
    assert allowed and all(tok.decode([t]).startswith("{") for t in allowed), allowed
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
    print("HEAVY:" + ",".join(heavy))
    """
)


def test_tokenizer_and_grammar_import_neither_torch_nor_transformers(tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", TORCH_FREE, tiny_model_dir],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("HEAVY:")] == ["HEAVY:"], proc.stdout
