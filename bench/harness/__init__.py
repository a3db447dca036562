"""What every benchmark here shares; each script asks one question with it (``bench/README.md`` maps them).

- :mod:`bench.harness.launch`: a ``lit-ddp fit`` command and its environment, running it, free ports, a gloo group, a
  process's start time, and the process-tree runner (time boxes, the leftovers of a part);
- :mod:`bench.harness.clock`: the step clock's file, its reader, tokens/s and MFU from it;
  :mod:`bench.harness.callback`: :class:`~bench.harness.callback.StepClock`, the Lightning callback writing it;
- :mod:`bench.harness.measure`: a script's arguments and JSON, alternate-and-median timing, timed calls, peak FLOP/s,
  the markdown table; :mod:`bench.harness.turns`: two commands alive at once, run in turns;
- :mod:`bench.harness.ops`: steps outside a fit: the recipe's step, gpu.yaml's model, an aten op counter.

Only ``callback`` imports Lightning and only ``callback`` and ``ops`` torch at import: a timed plain loop's start-up
and the GPU check's own process stay free of them.
"""
