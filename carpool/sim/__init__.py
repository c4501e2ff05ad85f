"""`carpool simulate`: the real schedulers driven by a step-cost model instead of a model.

Nothing here imports torch: the simulator answers "what would continuous
batching buy on this workload" in milliseconds on any machine.
"""
