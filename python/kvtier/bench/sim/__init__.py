"""``kvtier simulate``: the bench's closed-loop replay at cluster scale, in virtual time.

The real scheduler and tiered pool run unchanged; the model's step time comes from a roofline
(or a fitted model) and every copy from modelled links. Modules: ``hardware`` (accelerators,
links, nodes), ``timing`` (step time), ``copies`` (virtual clock, copy engine, disk tier),
``engine`` (one worker), ``loop`` (the discrete-event loop), ``scenarios`` (named
experiments), ``run`` (sizing and running), ``calibrate`` (costs measured on this machine).
"""
