"""kvrelay.sim: a discrete-event simulator of a whole kvrelay fleet, and the tools built on it (docs/fleet.md).

Every decision is made by the production code: the gateway's Router and policies (gateway/), the index
mirror's map (kvrelay.index.mirror) following the nodes' block events, the registry (kvrelay.index.memory), and
each node's Scheduler, KVCacheManager and BlockPool (kvrelay.engine). Only the forward pass and the KV transfer
are replaced, by time models calibrated on a machine (`kvrelay sim calibrate`) or derived from a GPU's
datasheet (shipped profiles). One simulated clock runs the fleet: no threads, no sleeps; a seed fixes a run.

    trace.py      the JSONL trace format           workloads.py  trace generators (llm-d shape, chat, a day)
    timemodel.py  step / transfer / start-up time   gpus.py       roofline profiles of GPUs we cannot measure
    events.py     the clock and event queue         node.py       a node: the engine's scheduler, no model
    gateway.py    gateways and the index stream     dispatch.py   a request's way through the fleet
    fleet.py      the fleet on one clock            run.py        one simulation -> RunResult (results.py)
    calibrate.py  measure this machine's engine     plan.py       size a fleet for SLOs; autoscaling
    validate.py   simulator against real fleets     scale.py      routing at 8-256 nodes
    calibrate_served.py  what serving adds to the engine's steps (a real fleet against the simulator)
"""
