"""Configuration: defaults, file + CLI precedence, and the exact text of every validation error."""
import argparse
import os
import tomllib

import pytest

import moecached.daemon.config as config
from moecached import MoecacheError
from moecached.daemon.config import (Config, ConfigError, KEYS, add_cli_args, config_from_args, dump_toml,
                              arena_dir_refusal, load_config, reload_changes)
from moecached.facts.units import SIZE_EXPECTED

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "systemd", "moecached.toml.example")


@pytest.fixture(autouse=True)
def no_default_file(monkeypatch, tmp_path):
    # never read the machine's /etc/moecached/moecached.toml
    monkeypatch.setattr(config, "DEFAULT_PATH", str(tmp_path / "absent.toml"))


@pytest.fixture
def model(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF")
    return str(p)


def write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def parser():
    return add_cli_args(argparse.ArgumentParser(prog="moecached"))


def cli(*argv, check_runnable=False):
    return config_from_args(parser().parse_args(list(argv)), check_runnable=check_runnable)


def err_file(tmp_path, text, **kw):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as ei:
        load_config(path, check_runnable=kw.pop("check_runnable", False), **kw)
    msg = str(ei.value)
    assert "\n" not in msg
    return path, msg


def err_cli(*argv, check_runnable=False):
    with pytest.raises(ConfigError) as ei:
        cli(*argv, check_runnable=check_runnable)
    msg = str(ei.value)
    assert "\n" not in msg
    return msg


def test_defaults(monkeypatch):
    monkeypatch.setattr(config, "DEFAULT_GROUP", "no-such-group-moecached-test")
    c = load_config(check_runnable=False)
    assert c.endpoint == "ipc:///run/moecached/moecached.sock"
    assert c.arena_dir == "/dev/shm" and c.readers == 16 and c.chunk == 256 * KiB
    assert c.policy == "global" and c.on_pressure == "error" and c.heartbeat_s == 5.0
    assert c.socket_mode == 0o660 and c.arena_mode == 0o640
    assert c.group is None                     # the default group does not exist here
    assert c.floor is None and c.budget is None and c.slots is None
    assert c.lock_memory is True and c.direct_io is True and c.hugetlb is False and c.allow_tcp is False
    assert c.ipc_path == "/run/moecached/moecached.sock"
    assert all(v == "default" for v in c.sources.values())


def test_default_group_used_when_it_exists(monkeypatch):
    monkeypatch.setattr(config, "DEFAULT_GROUP", "root")
    assert load_config(check_runnable=False).group == "root"
    assert load_config(overrides={"group": ""}, check_runnable=False).group is None


def test_file_then_cli_precedence(tmp_path, model):
    path = write(tmp_path, f'model = "{model}"\nbudget = "8GiB"\nreaders = 4\nsocket_mode = 0o600\n'
                           'floor = "2G"\nlog_level = "DEBUG"\nlock_memory = false\n')
    c = config_from_args(parser().parse_args(["--config", path, "--readers", "8", "--lock-memory"]))
    assert c.model == model and c.budget == 8 * GiB and c.readers == 8 and c.socket_mode == 0o600
    assert c.floor == 2 * GiB and c.log_level == "debug" and c.lock_memory is True
    assert c.sources["readers"] == "command line" and c.sources["budget"] == path
    assert c.sources["chunk"] == "default" and c.path == path
    # --slots replaces the file's budget (and vice versa)
    c = config_from_args(parser().parse_args(["--config", path, "--slots", "100"]))
    assert c.slots == 100 and c.budget is None


def test_default_path_read_only_if_present(monkeypatch, tmp_path):
    p = write(tmp_path, "readers = 3\n", "default.toml")
    monkeypatch.setattr(config, "DEFAULT_PATH", p)
    assert load_config(check_runnable=False).readers == 3
    monkeypatch.setattr(config, "DEFAULT_PATH", str(tmp_path / "gone.toml"))
    assert load_config(check_runnable=False).readers == 16


def test_mode_forms(tmp_path):
    assert load_config(write(tmp_path, 'socket_mode = "0660"\narena_mode = "640"\n'),
                       check_runnable=False).arena_mode == 0o640
    assert cli("--socket-mode", "0o600").socket_mode == 0o600


def test_floor_off_forms(tmp_path):
    assert load_config(write(tmp_path, "floor = 0\n"), check_runnable=False).floor is None
    assert load_config(write(tmp_path, "floor = false\n"), check_runnable=False).floor is None
    assert cli("--floor", "0").floor is None
    assert cli("--floor", "1.5G").floor == 1536 * MiB


def test_tcp_allowed_when_configured():
    c = cli("--endpoint", "tcp://127.0.0.1:5555", "--allow-tcp")
    assert c.endpoint == "tcp://127.0.0.1:5555" and c.ipc_path is None


# -- exact error texts ---------------------------------------------------------------------------

SIZE = SIZE_EXPECTED
FILE_ERRORS = [
    ('readers = 0', 'readers = 0: expected an integer from 1 to 1024'),
    ('max_prefetch_loads = -1', 'max_prefetch_loads = -1: expected an integer from 0 to 1048576'),
    ('client_max_prefetch = -1', 'client_max_prefetch = -1: expected an integer from 0 to 1048576'),
    ('prefetch_min_confidence = 1.5', 'prefetch_min_confidence = 1.5: expected a number from 0 to 1'),
    ('client_rate_limit = "fast"', 'client_rate_limit = "fast": expected a number of requests per second '
                                   'from 0 (off) to 1e9'),
    ('client_rate_limit = -5', 'client_rate_limit = -5: expected a number of requests per second '
                               'from 0 (off) to 1e9'),
    ('client_rate_burst = 0', f'client_rate_burst = 0: expected an integer from 1 to {1 << 30}'),
    ('readers = "16"', 'readers = "16": expected an integer from 1 to 1024'),
    ('readers = true', 'readers = true: expected an integer from 1 to 1024'),
    ('slots = 0', f'slots = 0: expected an integer from 1 to {1 << 24}'),
    ('budget = "8GG"', f'budget = "8GG": expected {SIZE}, more than 0 bytes'),
    ('budget = 0', f'budget = 0: expected {SIZE}, more than 0 bytes'),
    ('budget = -1', f'budget = -1: expected {SIZE}, more than 0 bytes'),
    ('chunk = "1000"', f'chunk = "1000": expected {SIZE}, at least 4 KiB, at most 64 MiB, a multiple of 4 KiB'),
    ('chunk = "128M"', f'chunk = "128M": expected {SIZE}, at least 4 KiB, at most 64 MiB, a multiple of 4 KiB'),
    ('floor = "lots"', f'floor = "lots": expected {SIZE}; 0 or false turns it off'),
    ('floor_hysteresis = "x"', f'floor_hysteresis = "x": expected {SIZE}'),
    ('min_budget = [1]', f'min_budget = [1]: expected {SIZE}'),
    ('max_message_bytes = "1K"', f'max_message_bytes = "1K": expected {SIZE}, at least 4 KiB, at most 1 GiB'),
    ('max_request_experts = 0', f'max_request_experts = 0: expected an integer from 1 to {1 << 24}'),
    ('policy = "lru"', 'policy = "lru": expected "global" or "per-layer"'),
    ('on_pressure = "block"', 'on_pressure = "block": expected "error" or "wait"'),
    ('on_model_change = "restart"', 'on_model_change = "restart": expected "reload" or "exit"'),
    ('log_level = "loud"', 'log_level = "loud": expected "debug" or "info" or "warning" or "error"'),
    ('hugetlb = "yes"', 'hugetlb = "yes": expected true or false'),
    ('lock_memory = 1', 'lock_memory = 1: expected true or false'),
    ('direct_io = "no"', 'direct_io = "no": expected true or false'),
    ('allow_tcp = 0', 'allow_tcp = 0: expected true or false'),
    ('heartbeat_s = 0', 'heartbeat_s = 0: expected a number of seconds > 0 and <= 3600'),
    ('heartbeat_s = "5s"', 'heartbeat_s = "5s": expected a number of seconds > 0 and <= 3600'),
    ('floor_interval_s = 61', 'floor_interval_s = 61: expected a number of seconds > 0 and <= 60'),
    ('floor_min_change_s = -1', 'floor_min_change_s = -1: expected a number of seconds >= 0 and <= 3600'),
    ('pressure_timeout_s = 1e9', 'pressure_timeout_s = 1000000000.0: expected a number of seconds >= 0 and <= 3600'),
    ('socket_mode = 660', 'socket_mode = 660: expected a file mode from 0o000 to 0o777: '
                          '0o660 (a TOML octal integer) or "0660"'),
    ('arena_mode = "rw-r-----"', 'arena_mode = "rw-r-----": expected a file mode from 0o000 to 0o777: '
                                 '0o660 (a TOML octal integer) or "0660"'),
    ('arena_dir = "shm"', 'arena_dir = "shm": expected an absolute path'),
    ('model = ""', 'model = "": expected the path of a GGUF file'),
    ('model = 3', 'model = 3: expected the path of a GGUF file'),
    ('endpoint = "ipc://relative.sock"', 'endpoint = "ipc://relative.sock": expected ipc:///absolute/path '
                                         '(at most 107 bytes) or tcp://HOST:PORT'),
    (f'endpoint = "ipc:///{"x" * 120}"', f'endpoint = "ipc:///{"x" * 120}": expected ipc:///absolute/path '
                                         '(at most 107 bytes) or tcp://HOST:PORT'),
    ('endpoint = "inproc://x"', 'endpoint = "inproc://x": expected ipc:///absolute/path (at most 107 bytes) '
                                'or tcp://HOST:PORT'),
    ('endpoint = "tcp://h:99999"\nallow_tcp = true', 'endpoint = "tcp://h:99999": expected ipc:///absolute/path '
                                                     '(at most 107 bytes) or tcp://HOST:PORT'),
    ('group = "no-such-group-moecached-test"', 'group = "no-such-group-moecached-test": expected an existing '
                                               'group (name or gid), or "" for none'),
    ('group = 3.5', 'group = 3.5: expected an existing group (name or gid), or "" for none'),
    ('fast_path = "yes"', 'fast_path = "yes": expected true or false'),
    ('client_loop_share = 1.5', 'client_loop_share = 1.5: expected a number from 0 to 1'),
    ('admin_group = "no-such-group-moecached-test"', 'admin_group = "no-such-group-moecached-test": '
                                                     'expected an existing group (name or gid), or "" for none'),
    ('model_dirs = ["srv/models"]', "model_dirs = [\"srv/models\"]: expected absolute directory paths (a "
                                    "list of strings, or one string of paths separated by ':')"),
    ('eviction = "arc"', 'eviction = "arc": expected "lru" or "lfu-decay" or "lfu-subst" or "slru"'),
    ('scan_admit = "middle"', 'scan_admit = "middle": expected "cold" or "probation"'),
    ('admit_cold = "scan"', 'admit_cold = "scan": expected "off", "prompt" or a width from 1 to '
                            '16777216 (experts of one layer in one acquire)'),
    ('admit_cold = 0', 'admit_cold = 0: expected "off", "prompt" or a width from 1 to 16777216 '
                       '(experts of one layer in one acquire)'),
    ('fast_path_quota = -1', 'fast_path_quota = -1: expected an integer from 0 to 16777216'),
    ('fast_path_hit_rate = -1', 'fast_path_hit_rate = -1: expected a number of ring entries per '
                                'second from 0 (no limit) to 1e9'),
    ('models = 3', 'models = 3: expected a list of tables with name (letters, digits, _ . -, at most '
                   '32), path (a GGUF file) and optional min_budget, max_budget (sizes) and weight (> 0)'),
    ('split_interval_s = 0', 'split_interval_s = 0: expected a number of seconds > 0 and <= 86400'),
    ('split_step = 0', 'split_step = 0: expected a size such as 8GiB, 512M, 1.5G or a byte count (units '
                       'B, K/KiB, M/MiB, G/GiB, T/TiB binary; KB, MB, GB, TB decimal), more than 0 bytes'),
    ('split_hysteresis = -1', 'split_hysteresis = -1: expected a number from 0 to 100 (0.25: a move '
                              'must gain 25 % more than it loses)'),
    ('state_dir = "state"', 'state_dir = "state": expected an absolute path, or "" for no warm starts'),
    ('state_interval_s = -1', 'state_interval_s = -1: expected a number of seconds >= 0 and <= 86400'),
    ('fill_run = "2GiB"', 'fill_run = "2GiB": expected a size such as 8GiB, 512M, 1.5G or a byte count '
                          '(units B, K/KiB, M/MiB, G/GiB, T/TiB binary; KB, MB, GB, TB decimal), at '
                          'most 1 GiB'),
    ('fill_io = "mmap"', 'fill_io = "mmap": expected "direct" or "buffered"'),
    ('[server]\nx = 1', '[server] is a table: expected top-level keys only (key = value lines, no '
                        '[section] headers, dotted keys or inline tables)'),
    ('readers = 4\n[section]\nbudget = "8G"', '[section] is a table: expected top-level keys only '
                                              '(key = value lines, no [section] headers, dotted keys or '
                                              'inline tables)'),
    ('[[server]]\nx = 1', '[[server]] is an array of tables: expected top-level keys only (key = value lines)'),
]


@pytest.mark.parametrize("text,expected", FILE_ERRORS, ids=[e[1].split(" ")[0] + str(i) for i, e in enumerate(FILE_ERRORS)])
def test_file_error_text(tmp_path, text, expected):
    path, msg = err_file(tmp_path, text + "\n")
    assert msg == f"{path}: {expected}"


def test_every_key_has_an_error_case():
    covered = {t.split(" ")[0].split("=")[0] for t, _ in FILE_ERRORS}
    assert set(KEYS) <= covered | {"budget"}, set(KEYS) - covered


def test_unknown_key_did_you_mean(tmp_path):
    path, msg = err_file(tmp_path, 'budjet = "8G"\n')
    assert msg == f'{path}: unknown key "budjet" (did you mean "budget"?)'
    path, msg = err_file(tmp_path, 'zzz = 1\n')
    assert msg == f'{path}: unknown key "zzz"'
    with pytest.raises(ConfigError) as ei:
        load_config(overrides={"socket_mod": 0o600}, check_runnable=False, origin="override")
    assert str(ei.value) == 'override: unknown key "socket_mod" (did you mean "socket_mode"?)'


def test_invalid_toml_and_missing_file(tmp_path):
    path, msg = err_file(tmp_path, 'readers = \n')
    assert msg.startswith(f"{path}: invalid TOML: ") and "line 1" in msg
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError) as ei:
        load_config(missing, check_runnable=False)
    assert str(ei.value) == f"{missing}: cannot read the config file: no such file"
    with pytest.raises(ConfigError) as ei:
        load_config(str(tmp_path), check_runnable=False)
    assert str(ei.value) == f"{tmp_path}: cannot read the config file: it is a directory"


def test_cross_key_errors(tmp_path, model):
    path, msg = err_file(tmp_path, 'budget = "1G"\nslots = 10\n')
    assert msg == f"{path}: budget and slots are both set: expected only one of them"
    path, msg = err_file(tmp_path, 'endpoint = "tcp://*:5555"\n')
    assert msg == (f'{path}: endpoint = "tcp://*:5555": expected an ipc:// endpoint; tcp:// has no access '
                   'control and needs allow_tcp = true (or --allow-tcp)')
    path, msg = err_file(tmp_path, 'budget = "1G"\nmin_budget = "2G"\n')
    assert msg == f'{path}: min_budget = "2G": expected at most the budget (1073741824 bytes)'


def test_runnable_errors(tmp_path, model):
    path, msg = err_file(tmp_path, 'budget = "1G"\n', check_runnable=True)
    assert msg == (f'{path}: model is not set: expected model = "/path/to/model.gguf" in the config file '
                   'or --model PATH')
    path, msg = err_file(tmp_path, f'model = "{tmp_path}/x.gguf"\nbudget = "1G"\n', check_runnable=True)
    assert msg == f'{path}: model = "{tmp_path}/x.gguf": expected an existing GGUF file (no such file)'
    path, msg = err_file(tmp_path, f'model = "{tmp_path}"\nbudget = "1G"\n', check_runnable=True)
    assert msg == f'{path}: model = "{tmp_path}": expected an existing GGUF file (not a regular file)'
    path, msg = err_file(tmp_path, f'model = "{model}"\n', check_runnable=True)
    assert msg == (f'{path}: neither budget nor slots is set: expected budget = "SIZE" or slots = N in the '
                   'config file, or --budget / --slots')
    path, msg = err_file(tmp_path, f'model = "{model}"\nslots = 4\narena_dir = "/nonexistent-dir"\n',
                         check_runnable=True)
    assert msg == f'{path}: arena_dir = "/nonexistent-dir": expected an existing directory'
    assert load_config(write(tmp_path, f'model = "{model}"\nslots = 4\n'), check_runnable=True).slots == 4


def test_cli_error_texts(model):
    assert err_cli("--readers", "0") == "command line: --readers 0: expected an integer from 1 to 1024"
    assert err_cli("--readers", "many") == "command line: --readers many: expected an integer from 1 to 1024"
    assert err_cli("--budget", "8GG") == f"command line: --budget 8GG: expected {SIZE}, more than 0 bytes"
    assert err_cli("--heartbeat", "x") == ("command line: --heartbeat x: expected a number of seconds > 0 "
                                           "and <= 3600")
    assert err_cli("--policy", "lfu") == 'command line: --policy lfu: expected "global" or "per-layer"'
    assert err_cli("--endpoint", "tcp://*:1") == (
        "command line: --endpoint 'tcp://*:1': expected an ipc:// endpoint; tcp:// has no access control "
        "and needs allow_tcp = true (or --allow-tcp)")
    assert err_cli("--budget", "1G", "--min-budget", "2G") == (
        "command line: --min-budget 2G: expected at most the budget (1073741824 bytes)")
    assert err_cli("--model", "/nonexistent.gguf", "--budget", "1G", check_runnable=True) == (
        "command line: --model /nonexistent.gguf: expected an existing GGUF file (no such file)")
    assert err_cli("--budget", "1G", check_runnable=True) == (
        'configuration: model is not set: expected model = "/path/to/model.gguf" in the config file '
        'or --model PATH')
    with pytest.raises(ConfigError) as ei:
        load_config(overrides={"readrs": 1}, cli=True, origin="command line", check_runnable=False)
    assert str(ei.value) == 'command line: unknown key "--readrs" (did you mean "--readers"?)'


def test_config_error_is_moecache_error():
    assert issubclass(ConfigError, MoecacheError)


def test_reload_changes(tmp_path):
    a = load_config(write(tmp_path, 'budget = "8G"\nfloor = "2G"\nreaders = 4\n'), check_runnable=False)
    b = load_config(write(tmp_path, 'budget = "6G"\nfloor = "3G"\nreaders = 8\n', "b.toml"), check_runnable=False)
    apply, restart = reload_changes(a, b)
    assert apply == {"budget": (8 * GiB, 6 * GiB), "floor": (2 * GiB, 3 * GiB)}
    assert restart == ["readers"]


def test_dump_round_trips(tmp_path):
    c = cli("--budget", "3GiB", "--floor", "1G", "--socket-mode", "0600")
    text = dump_toml(c)
    c2 = load_config(write(tmp_path, text), check_runnable=False)
    assert c2.as_dict() == c.as_dict()


def test_example_file_is_valid_and_complete(tmp_path, model):
    with open(EXAMPLE, "rb") as f:
        tomllib.load(f)       # parses
    text = open(EXAMPLE).read()
    for key in KEYS:
        assert f"{key} =" in text, f"{key} missing from moecached.toml.example"
    c = load_config(EXAMPLE, check_runnable=False)
    assert c.readers == 16 and c.endpoint == Config().endpoint


def test_every_key_has_a_flag():
    p = parser()
    flags = {a for act in p._actions for a in act.option_strings}
    for key, k in KEYS.items():
        assert k.flag in flags
    assert "--config" in flags and "--no-lock-memory" in flags


@pytest.mark.parametrize("value", ["1e30", '"99999999999999999999999999"', '"2000000TiB"'])
def test_sizes_over_one_eib_are_refused(tmp_path, value):
    """A huge size (a typo, or 1e30) is refused: it once reached stats, where msgpack cannot
    carry integers >= 2**64, and broke `stats` and the exporter until the floor was turned off."""
    path, msg = err_file(tmp_path, f"floor = {value}\n")
    assert msg.startswith(f"{path}: floor = ") and msg.endswith("at most 1 EiB"), msg


def test_docs_mark_exactly_the_reloadable_keys():
    """docs/operations.md's configuration table marks *reload* exactly the keys whose row in
    config.KEYS names a live change (reload), and lists every key."""
    import re
    from pathlib import Path
    from moecached.daemon.config import KEYS, RELOADABLE
    doc = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"(?m)^\| `([a-z_]+)` \| `--[a-z-]+` \|.*$", doc)}
    assert set(KEYS) <= set(rows), sorted(set(KEYS) - set(rows))
    marked = {k for k in KEYS if "*reload*" in rows[k]}
    assert marked == RELOADABLE, (sorted(marked - RELOADABLE), sorted(RELOADABLE - marked))
    assert RELOADABLE == {k for k, key in KEYS.items() if key.reload is not None}


def test_several_models_from_tables_and_flags(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"x")
    b.write_bytes(b"x")
    p = tmp_path / "m.toml"
    p.write_text(f'budget = "2GiB"\n[[models]]\nname = "qwen"\npath = "{a}"\nmax_budget = "1GiB"\n'
                 f'[[models]]\nname = "mix"\npath = "{b}"\nweight = 2\n')
    cfg = load_config(str(p))
    assert [m["name"] for m in cfg.models] == ["qwen", "mix"] and cfg.model is None
    assert cfg.models[0]["max_budget"] == 1 << 30 and cfg.models[1]["weight"] == 2.0
    p.write_text(f'budget = "2GiB"\n[[models]]\nname = "q w"\npath = "{a}"\n')
    with pytest.raises(ConfigError, match=r"models\[0\]\.name = 'q w' is not such a name"):
        load_config(str(p))
    p.write_text(f'budget = "2GiB"\n[[models]]\nname = "q"\npath = "{tmp_path}/none.gguf"\n')
    with pytest.raises(ConfigError, match="model q: path = .*none.gguf.*no such file"):
        load_config(str(p))
    import argparse
    ap = add_cli_args(argparse.ArgumentParser())
    cfg = config_from_args(ap.parse_args(["--config", str(tmp_path / "none.toml")][:0] + [
        "--model", f"qwen={a}", "--model", f"mix={b}", "--budget", "1GiB"]))
    assert [(m["name"], m["path"]) for m in cfg.models] == [("qwen", str(a)), ("mix", str(b))]
    cfg = config_from_args(ap.parse_args(["--model", str(a), "--budget", "1GiB"]))
    assert cfg.model == str(a) and cfg.models == []
    with pytest.raises(ConfigError, match="--model NAME=PATH for each"):
        config_from_args(ap.parse_args(["--model", str(a), "--model", f"mix={b}", "--budget", "1G"]))


@pytest.mark.parametrize("argv, text", [
    # a prefix of another option is not that option: --socket is not --socket-mode
    (["--socket", "/tmp/x.sock"], "unknown option --socket (did you mean --endpoint ipc://PATH?)"),
    (["--slot=4"], "unknown option --slot (did you mean --slots?)"),
    (["--budg", "8G"], "unknown option --budg (did you mean --budget?)"),
    (["model.gguf"], "unexpected argument 'model.gguf': options only (the model: --model PATH)"),
])
def test_daemon_command_line_takes_no_abbreviation(argv, text, capsys):
    from moecached.daemon.cli import main
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == f"moecached: error: {text}; moecached --help lists them"



def test_arena_dir_list_takes_the_first_mount_this_user_can_write(tmp_path):
    """arena_dir = [A, B, ...] in the file: the first mount point (a tmpfs such as a huge-page
    one, /dev/shm) this user can write to and root or this user owns; an empty directory where a
    mount failed is passed over; none: one line naming them. A SIGHUP with the same list keeps
    the running arena's directory; --print-config writes the list."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    f = tmp_path / "c.toml"
    f.write_text(f'model = "{model}"\nslots = 4\narena_dir = ["{a}", "{b}", "/dev/shm"]\n')
    c = load_config(str(f), check_runnable=False)
    assert c.arena_dir == "/dev/shm" and c.arena_dir_choices == [str(a), str(b), "/dev/shm"]
    assert f'arena_dir = ["{a}", "{b}", "/dev/shm"]   # takes "/dev/shm"' in dump_toml(c).splitlines()
    # the command line's --arena-dir is one directory, and replaces the file's list
    assert load_config(str(f), {"arena_dir": str(a)}, check_runnable=False, cli=True).arena_dir == str(a)
    f2 = tmp_path / "none.toml"
    f2.write_text(f'model = "{model}"\nslots = 4\narena_dir = ["{a}", "{tmp_path}/y"]\n')
    with pytest.raises(ConfigError) as e:
        load_config(str(f2))
    assert str(e.value) == (f'{f2}: arena_dir = ["{a}", "{tmp_path}/y"]: expected among them a tmpfs or hugetlbfs '
                            f"mount point owned by root or this user and writable by it (none is: {a}: not a mount "
                            f"point, {tmp_path}/y: missing); mount one (systemd/run-moecached\\x2darena.mount) or "
                            "add /dev/shm")
    # a mount of another kind (a disk, /proc) is passed over with its kind named; hugetlb = true takes
    # hugetlbfs only; a SIGHUP with the running list keeps its directory even when none is usable now
    assert arena_dir_refusal("/proc") == "a proc mount, not tmpfs or hugetlbfs"
    f3 = tmp_path / "kinds.toml"
    f3.write_text(f'model = "{model}"\nslots = 4\narena_dir = ["/proc", "/dev/shm"]\n')
    c3 = load_config(str(f3), check_runnable=False)
    assert c3.arena_dir == "/dev/shm" and c3.arena_dir_refused == {"/proc": "a proc mount, not tmpfs or hugetlbfs",
                                                                   "/dev/shm": None}
    f3.write_text(f'model = "{model}"\nslots = 4\nhugetlb = true\narena_dir = ["/dev/shm"]\n')
    with pytest.raises(ConfigError, match=r"none is: /dev/shm: not hugetlbfs \(hugetlb = true\)"):
        load_config(str(f3))
    kept = load_config(str(f2), check_runnable=False)
    kept.arena_dir = "/dev/shm"   # as if it had been usable when the daemon started
    again = load_config(str(f2), running=kept)
    assert again.arena_dir == "/dev/shm" and again.arena_dir_refused is None
    for bad, why in (('[]', ""), ('["shm"]', " (entry 1, 'shm', is not an absolute path)"),
                     ('["/dev/shm", 1]', " (entry 2, 1, is not an absolute path)")):
        f2.write_text(f'model = "{model}"\nslots = 4\narena_dir = {bad}\n')
        with pytest.raises(ConfigError) as e:
            load_config(str(f2))
        assert str(e.value).endswith("expected an absolute path, or a list of them" + why), str(e.value)
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    import subprocess
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(b)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        assert load_config(str(f), check_runnable=False).arena_dir == str(b)
        c2 = load_config(str(f), check_runnable=False, running=c)
        apply, restart = reload_changes(c, c2)   # the same list: the running arena stays put
        assert "arena_dir" not in restart and "arena_dir" not in apply and c2.arena_dir == "/dev/shm"
        # a link to the mount is resolved: clients are told the mount point, not a path a link can move
        link = tmp_path / "link"
        link.symlink_to(b)
        f4 = tmp_path / "link.toml"
        f4.write_text(f'model = "{model}"\nslots = 4\narena_dir = ["{link}", "/dev/shm"]\n')
        assert load_config(str(f4), check_runnable=False).arena_dir == str(b)
        # a root-owned mount under a directory another user owns: that user could rename the
        # directory (the mount goes with it) and put its own files at the arena's path
        os.chown(tmp_path, 65534, 65534)
        try:
            c6 = load_config(str(f), check_runnable=False)
            assert c6.arena_dir == "/dev/shm" and c6.arena_dir_refused[str(b)] == f"under {tmp_path}, owned by uid 65534"
        finally:
            os.chown(tmp_path, 0, 0)
        os.chmod(tmp_path, 0o777)   # or writable by everyone, not sticky
        try:
            assert load_config(str(f), check_runnable=False).arena_dir_refused[str(b)] == \
                f"under {tmp_path}, writable by other users"
        finally:
            os.chmod(tmp_path, 0o700)
        os.chown(b, 65534, 65534)   # another user's mount: its files could be swapped under the daemon
        os.chmod(b, 0o777)
        c5 = load_config(str(f), check_runnable=False)
        assert c5.arena_dir == "/dev/shm" and c5.arena_dir_refused[str(b)] == "owned by uid 65534"
    finally:
        subprocess.run(["umount", "-l", str(b)], capture_output=True)
