"""Lab tooling: benchmarks, studies, references and the audit.

SIMULATION ONLY: much of it reads every party's file, which no deployed bank can. The product
(``bank`` outside ``lab``) never imports from here.
"""

__all__: list[str] = []
