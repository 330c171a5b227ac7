"""kvpool's dev tooling (the ``kvpool-dev`` distribution in ``devtools/``; never shipped).

- ``build``: the control-plane binaries, built from the Go module proxy and cached;
- ``certs`` + ``cluster``: a real control plane on loopback (etcd, kube-apiserver,
  controller-manager, scheduler, kwok GPU nodes) with its PKI and kubeconfigs;
- ``podagents``: a real local process for every Running pod (``PodAgentHarness``);
- ``kubelet``: the kubelet's part for agent pods (volumes, readiness) and pod DNS names;
- ``stack``: the chart, the operator under its ServiceAccount and agents, and a load;
- ``poll``: ``wait_until`` and loopback HTTP probes;
- ``cli``: ``kvpool-dev cluster build|up|down|env|status`` and ``kvpool-dev stack serve``.
"""
