"""The command line of train.py and scripts/collect_traces.py: `--config FILE[:ARG]` and
`--config.KEY=VALUE` overrides, through absl and ml_collections.

The config file is read once, here (`load_config_file`, which names the file's own line when
the file fails), and handed to ml_collections as a config dict, whose flags apply the
overrides. Before absl parses anything, every override naming a key the config lacks is listed
with the nearest valid names: ml_collections alone stops at the first, with a bare
AttributeError from inside its parser. Any command-line mistake is one message on stderr and
exit status 2, never a traceback.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import sys
import traceback
from typing import NoReturn

from absl import flags
from ml_collections import config_flags
from ml_collections.config_flags import config_path  # the key-path syntax the flags accept


def config_error(message) -> NoReturn:
    """A bad command line or config: printed as `<program>: message`, exit status 2."""
    print(f"{os.path.basename(sys.argv[0]) or 'train.py'}: {message}", file=sys.stderr)
    sys.exit(2)


def load_config_file(path: str | os.PathLike):
    """A `configs/<name>.py` file's `get_config()` (a ConfigDict), imported as a module;
    `file.py:argument` calls `get_config(argument)`, as ml_collections' --config does."""
    path, *argument = os.fspath(path).split(":", 1)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"_config_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ValueError(f"--config {path}: defines no get_config()")
        return module.get_config(*argument)
    except SyntaxError as e:
        raise ValueError(f"--config {e.filename or path}:{e.lineno}: {e.msg}") from None
    except (ValueError, FileNotFoundError):
        raise
    except Exception as e:  # a mistake inside the config file: name its line, not our stack
        frames = [
            f
            for f in traceback.extract_tb(e.__traceback__)
            if os.path.abspath(f.filename) == os.path.abspath(path)
        ]
        where = f"{path}:{frames[-1].lineno}" if frames else path
        raise ValueError(f"--config {where}: {type(e).__name__}: {e}") from None


def config_keys(config, prefix: str = "") -> list[str]:
    """Every key of a ConfigDict as a dotted path, nested ones included (`data.datasets`)."""
    keys = []
    for key, value in config.items():
        keys.append(prefix + key)
        if hasattr(value, "items"):
            keys += config_keys(value, prefix + key + ".")
    return keys


def unknown_keys(config, keys) -> list[str]:
    """One line per key (`jsd_bta`, `data.image_transform.max_sise`) that `config` lacks, with
    the nearest valid names."""
    known = config_keys(config)
    problems = []
    for key in keys:
        try:
            config_path.get_value(key, config)
            continue
        except (AttributeError, KeyError, IndexError, ValueError):
            pass
        close = difflib.get_close_matches(key, known, n=3)
        hint = (
            f"did you mean {', '.join(close)}?"
            if close
            else "nothing similar (configs/common.py lists every key)"
        )
        problems.append(f"{key}: no such key; {hint}")
    return problems


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing (app.run's `flags_parser`) with the config loaded and checked first;
    afterwards `config_flag_value()` is the config with the overrides applied."""
    argv = flags.FLAGS.read_flags_from_files(argv, force_gnu=False)  # --flagfile, as absl does
    path, keys, rest = None, [], []
    args = iter(enumerate(argv))
    for i, arg in args:
        if re.match(r"^--?config(=|$)", arg):  # --config=FILE or --config FILE
            path = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1 :] or [None])[0]
            if "=" not in arg:
                next(args, None)
            continue
        if re.match(r"^--?(no)?config\.", arg):  # --config.KEY=VALUE, --[no]config.KEY
            keys.append(arg.split("=", 1)[0].split(".", 1)[1])
        rest.append(arg)
    if not path:
        if any(arg in ("-h", "--help", "--helpshort", "--helpfull") for arg in rest):
            return flags.FLAGS(rest)  # absl prints the help and exits
        config_error("--config is required: python train.py --config configs/<name>.py")
    try:
        config = load_config_file(path)
    except (FileNotFoundError, ValueError) as e:
        config_error(e)
    problems = unknown_keys(config, keys)
    if problems:
        config_error(
            f"unknown config keys for {path}:\n  --config." + "\n  --config.".join(problems)
        )
    if "config" in flags.FLAGS:  # a second parse in one process (tests): the new file's flags
        for name in [n for n in flags.FLAGS if n == "config" or n.startswith("config.")]:
            delattr(flags.FLAGS, name)
    # ml_collections' override flags are made from `sys_argv` when the flag is defined.
    config_flags.DEFINE_config_dict("config", config, f"the config of {path}", sys_argv=rest)
    try:
        return flags.FLAGS(rest)
    except flags.Error as e:
        config_error(e)


def config_flag_value():
    """The run's config (a locked ConfigDict), after `parse_flags`."""
    return flags.FLAGS.config
