"""`kvtier calibrate`: measure the engine the user will run, and the tiers on this machine, into a profile.

The cost model's figures are stated defaults; a profile (`kvtier.sim.profile`) replaces them with what one engine
on one machine was measured to cost. `server` measures the engine over HTTP (prefill, decode), `tiers` kvtier's
own data path in this process (loads from each tier into an engine's pages, the store path's copy out of them),
`calibrate` fits both into a profile and checks that each fit reproduces its own points.
"""

from __future__ import annotations


class CalibrationError(ValueError):
    """A calibration that cannot be made: a server that does not answer (named by its URL), or answers in a way
    that cannot be measured. A ValueError, so that the CLI exits with code 2 naming it."""
