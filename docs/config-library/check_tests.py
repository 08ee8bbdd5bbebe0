"""The expectations of tests/test_config_env.py and test_service_config.py's mechanics cases,
run against the pydantic-settings prototype (pyd_config.load): how many hold unchanged.

    .venv/bin/python docs/config-library/check_tests.py
"""
import tomllib
import pyd_config as p

passed, failed = [], []

def expect_error(label, file_data, env, needles):
    try:
        p.load(file_data, env)
    except Exception as e:
        msg = str(e)
        missing = [n for n in needles if n not in msg]
        (failed if missing else passed).append((label, msg if missing else ""))
        return
    failed.append((label, "accepted"))

def expect_value(label, env, get, want):
    try:
        got = get(p.load({}, env))
    except Exception as e:
        failed.append((label, f"error {e}")); return
    (passed if got == want else failed).append((label, "" if got == want else f"got {got!r}"))

# test_misspelt_key_in_a_known_section_names_the_variable
for name, needle in [
    ("KVROUTER_SERVER__PORTT", "unknown key 'portt'"),
    ("KVROUTER_MODELS__KIMI__POLICYY", "unknown key 'policyy'"),
    ("KVROUTER_MODELS__KIMI__BUSY__MAX_CATS", "unknown key 'max_cats'"),
    ("KVROUTER_SERVER__PORT__X", "not a table"),
    ("KVROUTER_SERVER", "KVROUTER_SERVER__<KEY>"),
    ("KVROUTER_MODELS__KIMI", "KVROUTER_MODELS__<NAME>__<KEY>"),
    ("KVROUTER_MODELS__KIMI__BUSY", "a table"),
    ("KVROUTER_REPLICAS__URL", "KVROUTER_REPLICAS"),
    ("KVROUTER_SERVER_PORT", "KVROUTER_SERVER__PORT"),
    ("KVROUTER_MODELS_KIMI__POLICY", "KVROUTER_MODELS__<NAME>__<KEY>"),
]:
    expect_error(name, {}, {name: "1"}, [name, needle])
# test_unparsable_values_name_the_variable_and_the_type
for name, value, needle in [
    ("KVROUTER_SERVER__PORT", "80x", "an integer"),
    ("KVROUTER_SERVER__PORT", "1.0", "an integer"),
    ("KVROUTER_SERVER__PORT", "true", "an integer"),
    ("KVROUTER_SERVER__MAX_BODY_MB", "lots", "a number"),
    ("KVROUTER_SERVER__DEBUG_HEADER", "maybe", "true or false"),
    ("KVROUTER_MODELS__M__CONTEXT_LENGTH", "", "an integer"),
    ("KVROUTER_MODELS__M__BUSY__MAX_IN_FLIGHT", "many", "an integer"),
]:
    expect_error(f"{name}={value!r}", {}, {name: value}, [name, needle, repr(value)])
# test_string_settings_keep_the_raw_text
for name, value, get in [
    ("KVROUTER_SERVER__API_KEYS", "12345", lambda s: s.server.api_keys),
    ("KVROUTER_SERVER__GRPC_TOKEN", "true", lambda s: s.server.grpc_token),
    ("KVROUTER_SERVER__LOG_LEVEL", "0", lambda s: s.server.log_level),
    ("KVROUTER_SERVER__HOST", "1.5", lambda s: s.server.host),
    ("KVROUTER_SERVER__REDIS_KEY_PREFIX", "[1]", lambda s: s.server.redis_key_prefix),
    ("KVROUTER_ADMIN_TOKEN", "false", lambda s: s.server.admin_token),
    ("KVROUTER_MODELS__M__TOKENIZER", "2024", lambda s: s.models["m"].tokenizer),
    ("KVROUTER_SERVER__GRPC_TOKEN", '"quoted"', lambda s: s.server.grpc_token),
]:
    expect_value(f"{name}={value!r} stays text", {name: value}, get, value)
# test_other_components_variables_are_not_config
for name, value in {"KVROUTER_DEBUG": "1", "KVROUTER_REDIS_URL": "redis://h/0",
                    "KVROUTER_SIGNING_KEY": "00", "KVROUTER_SIGNING_MASTER": "11"}.items():
    expect_value(f"{name} ignored", {name: value}, lambda s: s.server.redis_url, None)
# test_admin_token_spellings_must_agree
expect_error("admin token spellings disagree", {}, {"KVROUTER_ADMIN_TOKEN": "t", "KVROUTER_SERVER__ADMIN_TOKEN": "u"}, ["KVROUTER_ADMIN_TOKEN"])
# test_errors_name_the_problem: the cases the mechanics decide (the domain rules stay code)
for text, needle in [
    ("[server]\nport = 'x'\n", "server.port"),
    ("[server]\nprot = 1\n", "unknown key 'prot'"),
    ("[models.m]\nblock_size = 0\n", "block_size"),
    ("[models.m.busy]\nmax_cats = 1\n", "models.m"),
    ("[whatever]\n", "unknown top-level"),
    ("[server]\nbody_memo_mb = -1\n", "server.body_memo_mb"),
    ("[server]\nbody_memo_mb = inf\n", "server.body_memo_mb"),
    ("[server]\nbody_memo_mb = nan\n", "server.body_memo_mb"),
    ("[server]\nmax_body_mb = inf\n", "server.max_body_mb"),
    ("[server]\nload_share_interval_s = -0.1\n", "server.load_share_interval_s"),
    ("[server]\nload_share_interval_s = nan\n", "server.load_share_interval_s"),
]:
    expect_error(text.replace("\n", " "), tomllib.loads(text), {}, [needle])
# file values of the wrong type the hand-written loader refuses (typed by declaration)
for text in ["[server]\nport = true\n", "[server]\nport = 9001.0\n", "[server]\ndebug_header = 1\n"]:
    expect_error(text.replace("\n", " ") + "(refused today)", tomllib.loads(text), {}, ["server."])

print(f"{len(passed)} of {len(passed) + len(failed)} expectations hold unchanged")
for label, why in failed:
    print(f"  FAIL {label}: {why}")
