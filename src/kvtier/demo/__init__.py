"""`kvtier demo`: the rollout on its embedded default (`kvtier.rollout`, held to its exactness check,
`kvtier.rollout.exactness`); or in-process, behind an engine stand-in that checks every restored block against its
recomputation (`in_process`)."""
