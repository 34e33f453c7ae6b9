"""A test build of kvtier whose restores are wrong: Python runs this at startup in every process that has this
folder on PYTHONPATH. Every block copied from a host slot into the engine gets the lowest bit of each of its
bf16 elements flipped (one ulp) after its checksum was verified, as a silent data-plane bug would."""

import kvtier.mover.handlers as handlers

_run, _run_many = handlers.SlotToCaller.run, handlers.SlotToCaller.run_many


def _corrupt(block) -> None:
    for part in block if isinstance(block, (list, tuple)) else [block]:
        if not isinstance(part, int):
            part.view(-1)[::2].bitwise_xor_(1)  # the low byte of every little-endian bf16 element


def run(self, step, io):
    result = _run(self, step, io)
    _corrupt(io.out[step.index])
    return result


def run_many(self, steps, io):
    _run_many(self, steps, io)
    for step in steps:
        _corrupt(io.out[step.index])


handlers.SlotToCaller.run, handlers.SlotToCaller.run_many = run, run_many
