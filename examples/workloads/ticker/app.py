"""ticker: a WebAssembly program in Python, built with componentize-py.

It exports `wasi:cli/run`, so a Trellis node runs it as a container's program. It
reads its configuration when it starts:

- the environment variable TICK_SECONDS: the seconds between two lines (default 5);
- the file /etc/ticker/message, a key of a ConfigMap mounted there: the line's text;
- the environment variable POD_NAME, when set (the downward API), for the first line;

then prints a numbered line every TICK_SECONDS seconds until it is stopped. A bad
configuration (TICK_SECONDS not a positive number, no message) is written to stderr
and the program exits with code 1, so its pod restarts with back-off.

Everything here runs inside `run`: componentize-py runs a module's top level when it
builds the component, not when the program starts.
"""

import os
import sys
import time

from wit_world import exports

CONFIG_DIR = "/etc/ticker"
DEFAULT_SECONDS = 5.0


class BadConfig(Exception):
    pass


def interval(value):
    """The seconds between lines, from TICK_SECONDS's value (None: the default)."""
    if value is None or value.strip() == "":
        return DEFAULT_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = None
    # NaN and infinity are not a number of seconds to wait either.
    if seconds is None or not 0 < seconds < 86400:
        raise BadConfig(f"TICK_SECONDS must be a number of seconds above 0, not {value!r}")
    return seconds


def message(config_dir):
    path = os.path.join(config_dir, "message")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except FileNotFoundError:
        raise BadConfig(f"{path} is missing: mount a ConfigMap with a `message` key at {config_dir}")
    except OSError as e:
        raise BadConfig(f"cannot read {path}: {e.strerror or e}")
    if not text:
        raise BadConfig(f"{path} is empty")
    # One line per tick, whatever the ConfigMap holds.
    return " ".join(text.split())


class Run(exports.Run):
    def run(self) -> None:
        # Not a terminal: without this, lines would wait in a buffer.
        sys.stdout.reconfigure(line_buffering=True)
        try:
            seconds = interval(os.environ.get("TICK_SECONDS"))
            text = message(CONFIG_DIR)
        except BadConfig as e:
            print(f"ticker: bad configuration: {e}", file=sys.stderr, flush=True)
            sys.exit(1)
        who = os.environ.get("POD_NAME") or "ticker"
        print(f"{who}: a line every {seconds:g} s, the message from {CONFIG_DIR}/message")
        tick = 0
        while True:
            tick += 1
            print(f"tick {tick}: {text}")
            time.sleep(seconds)
