"""A reward worker process: ``python -m trace_common.rewards.worker``.

It speaks length-prefixed pickles with the pool (`trace_common.rewards.pool`): first the
reward's (name, options), answered by ("ready", 0.0, "") or ("fatal", 0.0, why); then one
(row, completion) per call, answered by ("ok", value, "") or ("error", 0.0, why). The channel
is the stdin/stdout the pool gave it, moved to private descriptors at start-up: what a reward
prints goes to stderr (the trainer's log) and cannot corrupt the answers.
"""

from __future__ import annotations

import os
import sys

from trace_common.rewards.frames import read_frame, write_frame


def main() -> None:
    inp = os.fdopen(os.dup(0), "rb")
    out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # a reward's print() goes to stderr
    sys.stdout = sys.stderr
    from trace_common.rewards.registry import load_reward

    name, options = read_frame(inp)
    try:
        reward = load_reward(name, options)
    except Exception as e:
        write_frame(out, ("fatal", 0.0, f"{type(e).__name__}: {e}"))
        return
    write_frame(out, ("ready", 0.0, ""))
    while True:
        try:
            row, completion = read_frame(inp)
        except EOFError:
            return
        try:
            answer = ("ok", reward(row, completion), "")
        except Exception as e:
            answer = ("error", 0.0, f"{type(e).__name__}: {e}"[:2000])
        write_frame(out, answer)


if __name__ == "__main__":
    main()
