"""Custom rewards for the pool's tests, named as `custom_rewards:<function>`."""

from __future__ import annotations

import os
import time


def length(row, completion, *, per_char: float = 1.0):
    return per_char * len(completion)


length.fields = ("prompt",)


def sleepy(row, completion, *, seconds: float = 0.0):
    time.sleep(float(row.get("sleep", seconds)))
    return 1.0


def raises(row, completion):
    raise RuntimeError(f"cannot score {completion!r}")


def dies(row, completion):
    os._exit(3)


def chatty(row, completion):
    print("a reward that prints", flush=True)
    os.write(1, b"\x00\x00\x00\x05junk")  # even raw bytes on fd 1 miss the channel
    return 0.25


def not_a_number(row, completion):
    return "1.0"


def spawns(row, completion):
    import subprocess

    subprocess.Popen(["sleep", "300"])  # a child that would outlive a killed worker
    time.sleep(300)
    return 1.0
