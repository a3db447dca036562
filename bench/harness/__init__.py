"""What every benchmark here shares; each script asks one question with it (``bench/README.md`` maps them).

- :mod:`bench.harness.launch`: a ``lit-ddp fit`` command and its environment, running it, free ports, a process's
  start time, and the process-tree runner (time boxes, the leftovers of a part);
- :mod:`bench.harness.clock`: the step clock's file: what a run writes as it happens, and its reader;
- :mod:`bench.harness.callback`: :class:`~bench.harness.callback.StepClock`, the Lightning callback writing it;
- :mod:`bench.harness.measure`: alternate-and-median timing, peak FLOP/s, the save floor, the markdown table;
- :mod:`bench.harness.turns`: two commands alive at once, run in turns, for step-time ratios on a shared machine.

Only ``callback`` imports Lightning, and torch only ``callback`` and, inside them, ``measure``'s functions that need
it: a timed plain loop's start-up and the GPU check's own process stay free of them.
"""
