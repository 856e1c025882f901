"""``meshnet bench``: side-by-side comparisons that print ratios.

Every figure is measured against a baseline run in the same process and the
same run, because these machines are shared and absolute times drift. Each
comparison lives in a module of its own with one entry point::

    def run(options: BenchOptions) -> SectionResult

and the command stitches the sections into one table (and one JSON object
with ``--json``).
"""

from meshnet_bench._result import BenchOptions, SectionResult

__all__ = ["BenchOptions", "SectionResult"]
