"""understudyd: the per-node daemon and the cluster control plane on etcd.

Nothing in this package imports torch: the daemon never touches a GPU context itself.
"""
