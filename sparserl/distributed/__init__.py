"""Distributed plumbing shared by the Ray rollout workers, the learner ranks and the swarm: starting or joining
Ray (`cluster`), placing actors (`placement`), the trainable tensors that travel (`weights`) and how a policy
version reaches the rollout workers (`weight_sync`). Nothing here imports Ray: it is handed in by the caller,
which imports it only when a distributed part is built."""
