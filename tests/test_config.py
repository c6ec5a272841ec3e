"""Config: defaults, Config.from_env parsing of every variable, and ConfigError naming the variable."""

from __future__ import annotations

import dataclasses
import re

import pytest

from config import Config, ConfigError

ALL_VARS = (
    "MODEL_ID",
    "MAX_BATCH_SIZE",
    "MAX_QUEUE_DEPTH",
    "MAX_NEW_TOKENS_LIMIT",
    "DEVICE",
    "MAX_MODEL_LEN",
    "NUM_THREADS",
    "SMALL_GEMM",
    "STOP_TOKEN_IDS",
    "LORA_MODULES",
    "MAX_LORAS",
    "MAX_LORA_RANK",
    "HOST",
    "PORT",
    "SERVED_MODEL_NAME",
    "CHAT_TEMPLATE",
    "GENERIC_TOOLS",
    "EMBEDDING_POOLING",
    "MAX_QUEUE_TIME_S",
    "REQUEST_TIMEOUT_S",
    "MAX_LOGPROBS",
    "LOG_LEVEL",
    "API_KEY",
    "MAX_BODY_BYTES",
    "MAX_PROMPT_CHARS",
    "MAX_CONCURRENT_REQUESTS",
    "DRAIN_TIMEOUT_S",
    "FAKE_STEP_DELAY_S",
    "FAKE_STEP_FAULT_EVERY",
    "BODY_TIMEOUT_S",
    "HEADER_TIMEOUT_S",
    "TIMEOUT_KEEP_ALIVE_S",
    "LIMIT_CONCURRENCY",
    "MAX_HEADER_BYTES",
    "TOKENIZER_THREADS",
    "KV_BLOCK_SIZE",
    "KV_CACHE_MB",
    "KV_CACHE_DTYPE",
    "FAKE_KV_BLOCKS",
    "MAX_NUM_BATCHED_TOKENS",
    "MAX_PREFILL_TOKENS_WHILE_DECODING",
    "WEIGHTS",
    "RUNTIME",
    "KERNEL_ISA",
    "ACTIVATIONS",
    "PACK_WEIGHTS",
    "MAX_PROMPTS_PER_REQUEST",
    "CORS_ALLOW_ORIGINS",
    "PREFIX_CACHING",
    "MAX_N",
    "SPECULATIVE_METHOD",
    "SPECULATIVE_MODEL",
    "NUM_SPECULATIVE_TOKENS",
    "PROMPT_LOOKUP_MIN",
    "PROMPT_LOOKUP_MAX",
    "SPECULATIVE_DISABLE_BY_BATCH_SIZE",
    "SPECULATIVE_ADAPTIVE",
    "SCHEDULING_POLICY",
    "MAX_SEQUENCES_PER_REQUEST",
    "MAX_CLIENT_QUEUE_SHARE",
    "CLIENT_ID_HEADER",
    "MAX_LOGPROB_ENTRIES",
)


def test_defaults():
    cfg = Config()
    assert cfg.model_id == "distilgpt2"
    assert cfg.max_batch_size == 8
    assert cfg.max_queue_depth == 1024
    assert cfg.max_new_tokens_limit == 512
    assert cfg.device == "auto"
    assert cfg.max_model_len == 0
    assert cfg.num_threads == 0
    assert cfg.small_gemm is True
    assert cfg.stop_token_ids == ()
    assert cfg.host == "127.0.0.1"
    assert cfg.port == 8000
    assert cfg.prefix_caching is True and cfg.max_n == 8
    assert (cfg.max_queue_time_s, cfg.request_timeout_s) == (300.0, 600.0)
    assert cfg.scheduling_policy == "fair" and cfg.max_sequences_per_request == 256
    assert cfg.max_client_queue_share == 0.5 and cfg.client_id_header == ""
    assert not cfg.is_fake


def test_every_variable_has_a_field():
    assert sorted(f.name.upper() for f in dataclasses.fields(Config)) == sorted(ALL_VARS)


def test_from_env_empty_mapping_gives_defaults():
    assert Config.from_env({}) == Config()


@pytest.mark.parametrize("raw", ["", "   ", "\t"])
@pytest.mark.parametrize("var", ALL_VARS)
def test_blank_value_means_default(var, raw):
    assert Config.from_env({var: raw}) == Config()


def test_unrelated_variables_ignored():
    assert Config.from_env({"PATH": "/bin", "max_batch_size": "3", "FOO": "x"}) == Config()


@pytest.mark.parametrize(
    "var, raw, field, expected",
    [
        ("MODEL_ID", "fake", "model_id", "fake"),
        ("MODEL_ID", "  /models/tiny  ", "model_id", "/models/tiny"),
        ("MODEL_ID", "openai-community/gpt2", "model_id", "openai-community/gpt2"),
        ("MAX_BATCH_SIZE", "1", "max_batch_size", 1),
        ("MAX_BATCH_SIZE", " 16 ", "max_batch_size", 16),
        ("MAX_BATCH_SIZE", "1024", "max_batch_size", 1024),
        ("MAX_QUEUE_DEPTH", "1", "max_queue_depth", 1),
        ("MAX_QUEUE_DEPTH", "1000000", "max_queue_depth", 1_000_000),
        ("MAX_NEW_TOKENS_LIMIT", "1", "max_new_tokens_limit", 1),
        ("MAX_NEW_TOKENS_LIMIT", "2048", "max_new_tokens_limit", 2048),
        ("DEVICE", "auto", "device", "auto"),
        ("DEVICE", "cpu", "device", "cpu"),
        ("DEVICE", "cuda", "device", "cuda"),
        ("DEVICE", "cuda:0", "device", "cuda:0"),
        ("DEVICE", " cuda:12 ", "device", "cuda:12"),
        ("MAX_MODEL_LEN", "0", "max_model_len", 0),
        ("MAX_MODEL_LEN", "256", "max_model_len", 256),
        ("NUM_THREADS", "0", "num_threads", 0),
        ("NUM_THREADS", "4", "num_threads", 4),
        ("NUM_THREADS", "1024", "num_threads", 1024),
        ("MAX_PREFILL_TOKENS_WHILE_DECODING", "16", "max_prefill_tokens_while_decoding", 16),
        ("SMALL_GEMM", "false", "small_gemm", False),
        ("SMALL_GEMM", "0", "small_gemm", False),
        ("SMALL_GEMM", "No", "small_gemm", False),
        ("SMALL_GEMM", "true", "small_gemm", True),
        ("SMALL_GEMM", "1", "small_gemm", True),
        ("STOP_TOKEN_IDS", "5", "stop_token_ids", (5,)),
        ("STOP_TOKEN_IDS", "1,2,3", "stop_token_ids", (1, 2, 3)),
        ("STOP_TOKEN_IDS", " 7 , 9 ", "stop_token_ids", (7, 9)),
        ("STOP_TOKEN_IDS", "0,50256,", "stop_token_ids", (0, 50256)),
        ("STOP_TOKEN_IDS", "4,,8", "stop_token_ids", (4, 8)),
        ("HOST", "0.0.0.0", "host", "0.0.0.0"),
        ("HOST", "::1", "host", "::1"),
        ("PORT", "1", "port", 1),
        ("PORT", "8080", "port", 8080),
        ("PORT", "65535", "port", 65535),
    ],
)
def test_from_env_parses(var, raw, field, expected):
    cfg = Config.from_env({var: raw})
    assert getattr(cfg, field) == expected
    assert type(getattr(cfg, field)) is type(expected)
    # Every other field keeps its default.
    others = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(Config) if f.name != field}
    defaults = {f.name: getattr(Config(), f.name) for f in dataclasses.fields(Config) if f.name != field}
    assert others == defaults


def test_from_env_all_at_once():
    env = {
        "MODEL_ID": "fake",
        "MAX_BATCH_SIZE": "3",
        "MAX_QUEUE_DEPTH": "7",
        "MAX_NEW_TOKENS_LIMIT": "99",
        "DEVICE": "cpu",
        "MAX_MODEL_LEN": "128",
        "NUM_THREADS": "2",
        "STOP_TOKEN_IDS": "11,12",
        "HOST": "0.0.0.0",
        "PORT": "9001",
    }
    assert Config.from_env(env) == Config(
        model_id="fake",
        max_batch_size=3,
        max_queue_depth=7,
        max_new_tokens_limit=99,
        device="cpu",
        max_model_len=128,
        num_threads=2,
        stop_token_ids=(11, 12),
        host="0.0.0.0",
        port=9001,
    )


def test_from_env_reads_os_environ_by_default(monkeypatch):
    for var in ALL_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MAX_BATCH_SIZE", "5")
    monkeypatch.setenv("MODEL_ID", "fake")
    cfg = Config.from_env()
    assert cfg.max_batch_size == 5
    assert cfg.is_fake


@pytest.mark.parametrize(
    "var, raw",
    [
        ("MAX_BATCH_SIZE", "abc"),
        ("MAX_BATCH_SIZE", "1.5"),
        ("MAX_BATCH_SIZE", "0"),
        ("MAX_BATCH_SIZE", "-1"),
        ("MAX_BATCH_SIZE", "1025"),
        ("MAX_QUEUE_DEPTH", "many"),
        ("MAX_QUEUE_DEPTH", "0"),
        ("MAX_QUEUE_DEPTH", "1000001"),
        ("MAX_NEW_TOKENS_LIMIT", "ten"),
        ("MAX_NEW_TOKENS_LIMIT", "0"),
        ("MAX_NEW_TOKENS_LIMIT", "-5"),
        ("MAX_NEW_TOKENS_LIMIT", "1000001"),
        ("SMALL_GEMM", "maybe"),
        ("SMALL_GEMM", "2"),
        ("DEVICE", "gpu"),
        ("DEVICE", "mps"),
        ("DEVICE", "cuda:"),
        ("DEVICE", "cuda:x"),
        ("DEVICE", "cuda:-1"),
        ("DEVICE", "cpu:0"),
        ("MAX_MODEL_LEN", "-1"),
        ("MAX_MODEL_LEN", "1k"),
        ("NUM_THREADS", "-1"),
        ("NUM_THREADS", "1025"),
        ("NUM_THREADS", "two"),
        ("MAX_PREFILL_TOKENS_WHILE_DECODING", "-1"),
        ("MAX_PREFILL_TOKENS_WHILE_DECODING", "1048577"),
        ("MAX_PREFILL_TOKENS_WHILE_DECODING", "16 tokens"),
        ("STOP_TOKEN_IDS", "a"),
        ("STOP_TOKEN_IDS", "1,b"),
        ("STOP_TOKEN_IDS", "1;2"),
        ("STOP_TOKEN_IDS", "-1"),
        ("STOP_TOKEN_IDS", "3,-7"),
        ("PORT", "0"),
        ("PORT", "65536"),
        ("PORT", "-80"),
        ("PORT", "http"),
        ("PORT", "80.0"),
        ("PREFIX_CACHING", "sometimes"),
        ("MAX_N", "0"),
        ("MAX_N", "129"),
    ],
)
def test_bad_value_raises_config_error_naming_variable(var, raw):
    with pytest.raises(ConfigError) as info:
        Config.from_env({var: raw})
    message = str(info.value)
    assert re.match(rf"{var}\b", message), message
    # No other variable is blamed.
    assert not any(re.search(rf"\b{other}\b", message) for other in ALL_VARS if other != var)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "var, raw",
    [("MAX_BATCH_SIZE", "abc"), ("PORT", "80.0"), ("NUM_THREADS", "two"), ("STOP_TOKEN_IDS", "1,b")],
)
def test_parse_error_quotes_the_raw_value(var, raw):
    with pytest.raises(ConfigError, match=re.escape(repr(raw))):
        Config.from_env({var: raw})


def test_parse_error_is_not_chained_to_value_error():
    with pytest.raises(ConfigError) as info:
        Config.from_env({"PORT": "x"})
    assert info.value.__cause__ is None
    assert info.value.__suppress_context__


@pytest.mark.parametrize(
    "kwargs, var",
    [
        ({"model_id": ""}, "MODEL_ID"),
        ({"model_id": "   "}, "MODEL_ID"),
        ({"max_batch_size": 0}, "MAX_BATCH_SIZE"),
        ({"max_queue_depth": 0}, "MAX_QUEUE_DEPTH"),
        ({"max_new_tokens_limit": 0}, "MAX_NEW_TOKENS_LIMIT"),
        ({"device": "tpu"}, "DEVICE"),
        ({"max_model_len": -2}, "MAX_MODEL_LEN"),
        ({"num_threads": 2000}, "NUM_THREADS"),
        ({"stop_token_ids": (1, -1)}, "STOP_TOKEN_IDS"),
        ({"port": 70000}, "PORT"),
    ],
)
def test_direct_construction_is_validated(kwargs, var):
    with pytest.raises(ConfigError, match=rf"^{var}\b"):
        Config(**kwargs)


def test_device_error_quotes_the_value():
    with pytest.raises(ConfigError, match="'gpu'"):
        Config(device="gpu")


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_batch_size = 3  # type: ignore[misc]


@pytest.mark.parametrize("model_id, fake", [("fake", True), ("Fake", False), ("distilgpt2", False), ("fake2", False)])
def test_is_fake(model_id, fake):
    assert Config(model_id=model_id).is_fake is fake


@pytest.mark.parametrize(
    ("var", "raw", "field", "value"),
    [
        ("MAX_QUEUE_TIME_S", "2.5", "max_queue_time_s", 2.5),
        ("REQUEST_TIMEOUT_S", "30", "request_timeout_s", 30.0),
        ("MAX_LOGPROBS", "3", "max_logprobs", 3),
        ("MAX_PROMPTS_PER_REQUEST", "4", "max_prompts_per_request", 4),
        (
            "CORS_ALLOW_ORIGINS",
            "https://a.example, http://localhost:3000",
            "cors_origins",
            ["https://a.example", "http://localhost:3000"],
        ),
        ("SERVED_MODEL_NAME", "my-model", "served_model_name", "my-model"),
        ("SCHEDULING_POLICY", "fcfs", "scheduling_policy", "fcfs"),
        ("MAX_SEQUENCES_PER_REQUEST", "64", "max_sequences_per_request", 64),
        ("MAX_CLIENT_QUEUE_SHARE", "1", "max_client_queue_share", 1.0),
        ("CLIENT_ID_HEADER", "X-User-Id", "client_id_header", "X-User-Id"),
    ],
)
def test_operational_variables_parse(var, raw, field, value):
    assert getattr(Config.from_env({var: raw}), field) == value


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("MAX_QUEUE_TIME_S", "abc"),
        ("MAX_QUEUE_TIME_S", "nan"),
        ("MAX_QUEUE_TIME_S", "-1"),
        ("REQUEST_TIMEOUT_S", "inf"),
        ("MAX_LOGPROBS", "21"),
        ("MAX_LOGPROBS", "1.5"),
        ("MAX_PROMPTS_PER_REQUEST", "0"),
        ("MAX_PROMPTS_PER_REQUEST", "1025"),
        ("CORS_ALLOW_ORIGINS", "example.com"),
        ("CORS_ALLOW_ORIGINS", "https://a.example/path"),
        ("CORS_ALLOW_ORIGINS", "*, https://a.example"),
        ("SCHEDULING_POLICY", "priority"),
        ("MAX_SEQUENCES_PER_REQUEST", "0"),
        ("MAX_CLIENT_QUEUE_SHARE", "0"),
        ("MAX_CLIENT_QUEUE_SHARE", "1.5"),
        ("CLIENT_ID_HEADER", "X User"),
    ],
)
def test_operational_variables_reject_bad_values(var, raw):
    with pytest.raises(ConfigError, match=var):
        Config.from_env({var: raw})


def test_chat_template_reads_a_file(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert Config(chat_template=str(path)).chat_template_text() == "{{ messages }}"
    assert Config(chat_template="{{ x }}").chat_template_text() == "{{ x }}"
    assert Config().chat_template_text() is None
    assert Config(model_id="m", served_model_name="").model_name == "m"


# --- operations: logging, auth, limits, drain, FakeEngine knobs ------------------------------------


def test_operations_defaults():
    cfg = Config()
    assert cfg.log_level == "INFO"
    assert cfg.api_key == ""
    assert cfg.max_body_bytes == 1_048_576
    assert cfg.max_prompt_chars == 100_000
    assert cfg.max_concurrent_requests == 2048
    assert cfg.drain_timeout_s == 30.0
    assert cfg.fake_step_delay_s == 0.0 and cfg.fake_step_fault_every == 0
    assert cfg.host == "127.0.0.1"  # the default bind stays local


@pytest.mark.parametrize(
    ("var", "raw", "field", "value"),
    [
        ("LOG_LEVEL", "debug", "log_level", "debug"),
        ("LOG_LEVEL", "WARNING", "log_level", "WARNING"),
        ("API_KEY", "s3cret-key", "api_key", "s3cret-key"),
        ("MAX_BODY_BYTES", "1024", "max_body_bytes", 1024),
        ("MAX_BODY_BYTES", "10485760", "max_body_bytes", 10_485_760),
        ("MAX_PROMPT_CHARS", "0", "max_prompt_chars", 0),
        ("MAX_PROMPT_CHARS", "5000", "max_prompt_chars", 5000),
        ("MAX_CONCURRENT_REQUESTS", "0", "max_concurrent_requests", 0),
        ("MAX_CONCURRENT_REQUESTS", "64", "max_concurrent_requests", 64),
        ("DRAIN_TIMEOUT_S", "0", "drain_timeout_s", 0.0),
        ("DRAIN_TIMEOUT_S", "2.5", "drain_timeout_s", 2.5),
        ("FAKE_STEP_DELAY_S", "0.01", "fake_step_delay_s", 0.01),
        ("FAKE_STEP_FAULT_EVERY", "7", "fake_step_fault_every", 7),
    ],
)
def test_operations_variables_parse(var, raw, field, value):
    cfg = Config.from_env({var: raw})
    assert getattr(cfg, field) == value
    assert type(getattr(cfg, field)) is type(value)


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("LOG_LEVEL", "verbose"),
        ("LOG_LEVEL", "10"),
        ("MAX_BODY_BYTES", "0"),
        ("MAX_BODY_BYTES", "1023"),
        ("MAX_BODY_BYTES", "1e6"),
        ("MAX_BODY_BYTES", "3000000000"),
        ("MAX_PROMPT_CHARS", "-1"),
        ("MAX_PROMPT_CHARS", "lots"),
        ("MAX_CONCURRENT_REQUESTS", "-1"),
        ("MAX_CONCURRENT_REQUESTS", "1000001"),
        ("DRAIN_TIMEOUT_S", "-1"),
        ("DRAIN_TIMEOUT_S", "nan"),
        ("DRAIN_TIMEOUT_S", "inf"),
        ("DRAIN_TIMEOUT_S", "3601"),
        ("FAKE_STEP_DELAY_S", "-0.1"),
        ("FAKE_STEP_DELAY_S", "61"),
        ("FAKE_STEP_FAULT_EVERY", "-2"),
        ("FAKE_STEP_FAULT_EVERY", "0.5"),
    ],
)
def test_operations_variables_reject_bad_values(var, raw):
    with pytest.raises(ConfigError) as info:
        Config.from_env({var: raw})
    message = str(info.value)
    assert re.match(rf"{var}\b", message), message
    assert not any(re.search(rf"\b{other}\b", message) for other in ALL_VARS if other != var)


def test_api_key_is_not_in_the_repr():
    cfg = Config(api_key="top-secret-value")
    assert "top-secret-value" not in repr(cfg)
    assert cfg == Config.from_env({"API_KEY": "top-secret-value"})


def test_api_key_with_surrounding_whitespace_is_rejected_when_built_directly():
    with pytest.raises(ConfigError, match=r"^API_KEY\b"):
        Config(api_key=" key")
    assert Config.from_env({"API_KEY": " key\n"}).api_key == "key"  # the environment's value is stripped


@pytest.mark.parametrize("value", ["auto", "fp32", "int8", "int4"])
def test_weights_formats(value):
    assert Config.from_env({"WEIGHTS": value}).weights == value


@pytest.mark.parametrize("value", ["int2", "INT8", "bf16", "q4_1"])
def test_bad_weights_format_names_the_variable_and_the_choices(value):
    with pytest.raises(ConfigError, match=r"^WEIGHTS must be one of auto, fp32, int8, int4"):
        Config.from_env({"WEIGHTS": value})


@pytest.mark.parametrize("value", ["auto", "avx2"])
def test_kernel_isas(value):
    assert Config.from_env({"KERNEL_ISA": value}).kernel_isa == value


@pytest.mark.parametrize("value", ["auto", "fp32", "int8"])
def test_activations(value):
    assert Config.from_env({"ACTIVATIONS": value}).activations == value


@pytest.mark.parametrize("value", ["int4", "FP32", "on"])
def test_bad_activations_name_the_variable_and_the_choices(value):
    with pytest.raises(ConfigError, match=r"^ACTIVATIONS must be one of auto, fp32, int8 \(got"):
        Config.from_env({"ACTIVATIONS": value})


@pytest.mark.parametrize("value", ["auto", "off"])
def test_pack_weights(value):
    assert Config.from_env({"PACK_WEIGHTS": value}).pack_weights == value


@pytest.mark.parametrize("value", ["on", "true", "Q4_K"])
def test_bad_pack_weights_name_the_variable_and_the_choices(value):
    with pytest.raises(ConfigError, match=r"^PACK_WEIGHTS must be one of auto, off \(got"):
        Config.from_env({"PACK_WEIGHTS": value})


@pytest.mark.parametrize("value", ["avx512", "AVX2", "sse4"])
def test_bad_kernel_isa_names_the_variable_and_the_choices(value):
    with pytest.raises(ConfigError, match=r"^KERNEL_ISA must be one of auto, avx2 \(got"):
        Config.from_env({"KERNEL_ISA": value})


@pytest.mark.parametrize(
    "env, words",
    [
        ({"LORA_MODULES": "a"}, "LORA_MODULES must be name=path pairs"),
        ({"LORA_MODULES": "a=/x,a=/y"}, "names adapter 'a' twice"),
        ({"LORA_MODULES": "distilgpt2=/x"}, "has the base model's name"),
        ({"LORA_MODULES": "a=/x,b=/y", "MAX_LORAS": "1"}, "MAX_LORAS is 1"),
        ({"MAX_LORAS": "65"}, "MAX_LORAS must be in [0, 64]"),
        ({"MAX_LORA_RANK": "0"}, "MAX_LORA_RANK must be in [1, 512]"),
    ],
)
def test_lora_settings_are_checked(env, words):
    with pytest.raises(ConfigError) as info:
        Config.from_env(env)
    assert words in str(info.value), info.value


def test_lora_modules_parse():
    cfg = Config.from_env({"LORA_MODULES": " sql = /a/b , chat=/c ", "MAX_LORAS": "2"})
    assert cfg.lora_module_list == [("sql", "/a/b"), ("chat", "/c")]
