"""The studies: measurements behind docs/ that are not part of the product (disaggregated
serving against colocated instances and its planner and simulator, the KV cache tiers, the
ragged step against the row-shaped one, parallelism's collectives, the GRPO loop, the step
programs compiled for a GPU without one).
They import `jaxgen` and are not installed with it; run them from the repository's root:

    python -m benchmarks SECTION [options]      # e.g. python -m benchmarks disagg-sim --quick
    python -m benchmarks.disagg [options]       # the measured disaggregation study, its own flags
    python -m benchmarks.kvstore [options]

The drivers a user runs on their own model stay in the package (`jaxgen bench`)."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def study_env() -> dict[str, str]:
    """This process's environment with the repository's root on PYTHONPATH, for a study (not
    installed) that runs itself in a child process."""
    paths = [REPO, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
