"""``kvtier simulate``: the bench's closed-loop replay at cluster scale, in virtual time.

The real engine step, scheduler and tiered pool and the real replay loop
(:mod:`kvtier.bench.closed_loop`) run unchanged; the model's step time comes from a roofline (or a
model fitted on measured steps, :mod:`kvtier.sim.calibrate`) and every copy from modelled
links. Modules: ``hardware`` (accelerators, links, nodes), ``timing`` (step time), ``copies``
(virtual clock, copy engine, disk tier), ``engine`` (one worker: the engine with a timed runner),
``loop`` (the workers as the closed loop's target), ``scenarios`` (named experiments), ``run``
(sizing and running); the presets are data (``hardware.toml``, ``scenarios.toml``).
"""
