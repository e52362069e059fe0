"""Planning a run on a cluster: which layout (TP, PP and VPP, EP, ESP, DP, placement, all-to-all algorithm,
micro-batch, activation policy) fits in memory and trains fastest, predicted without running it.

`hardware` describes the cluster (GPU presets from data sheets, links, collective times), `model` the memory of
a layout, `step` its step time (the runtime's overlap cost model for the MoE layers, the pipeline bubble), and
`search` enumerates the layouts the run's own checks accept. tools/plan_cluster.py is the command line;
docs/planning.md says how to use it and what it assumes.
"""
