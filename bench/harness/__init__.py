"""What every benchmark here shares (``bench/README.md`` maps each question to its script): ``launch`` (a ``lit-ddp
fit`` command, its environment, ports, time boxes, the process tree), ``clock`` and ``callback`` (the step clock),
``measure`` (parsers, timing, peak FLOP/s, tables), ``turns`` (two commands alive at once, run in turns), ``ops``
(steps outside a fit). Only ``callback`` imports Lightning and only ``callback`` and ``ops`` torch at import: a timed
plain loop's start-up and the GPU check's own process stay free of them.
"""
