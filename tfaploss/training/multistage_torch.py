"""MultiStageModel's step on the PyTorch backend: stage 1 under ``torch.no_grad()``,
stage 2's ``backward()`` on a detached copy of the embeddings leaves ``G`` in its
``.grad``, stage 3 calls ``e_chunk.backward(G[chunk])`` (``.grad`` accumulates).

Under ``torch.distributed`` (W ranks, each on its shard of every global batch) stage 2
gathers the ranks' embeddings and ranks the GLOBAL batch on every rank; stage 3
backpropagates ``W * G[own rows]`` and the gradients are averaged over the ranks:
``sum_r J_r^T G_r = dL/dtheta``, the one-process gradient. The first step broadcasts
rank 0's weights, as DistributedDataParallel does.
"""

from __future__ import annotations

import keras
import torch
from keras import tree

from tfaploss.ops import distribute_torch


def _slice(x, start, stop):
    return tree.map_structure(lambda t: t[start:stop], x)


def _as_tensor(x):
    return None if x is None else keras.ops.convert_to_tensor(x)


class TorchSteps:
    """``train_step`` of ``MultiStageModel`` for ``KERAS_BACKEND=torch``."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._check_trainable()
        variables = self.trainable_variables
        batch = tree.flatten(x)[0].shape[0]
        ranks = distribute_torch.world_size()
        if ranks > 1 and not getattr(self, "_ranks_synced", False):
            distribute_torch.broadcast_from_first_rank(self.embedding_model.weights)
            self._ranks_synced = True
        self.zero_grad()

        if self.chunk_size is None:
            graph = self._embed(x)
            embeddings = graph.detach()
        else:
            bounds = self._chunk_bounds(batch)
            with torch.no_grad():
                embeddings = torch.cat([self._embed(_slice(x, a, b)) for a, b in bounds])

        global_y, global_embeddings, global_weight = y, embeddings, sample_weight
        if ranks > 1:
            global_y, global_embeddings, global_weight, (start, stop) = (
                distribute_torch.gather_ranks(_as_tensor(y), embeddings,
                                              _as_tensor(sample_weight)))

        leaf = global_embeddings.detach().requires_grad_(True)
        scaled, (total, memory_loss) = self._objective(global_y, leaf, global_weight)
        scaled.backward()
        grad_embeddings = leaf.grad.to(embeddings.dtype)
        if ranks > 1:
            grad_embeddings = grad_embeddings[start:stop] * ranks

        diff = torch.zeros((), dtype=torch.float32, device=embeddings.device)
        if self.chunk_size is None:
            graph.backward(grad_embeddings)
        else:
            for a, b in bounds:
                e_chunk = self._embed(_slice(x, a, b))
                e_chunk.backward(grad_embeddings[a:b])
                if self.check_stages:
                    with torch.no_grad():
                        d = self._max_abs_diff(e_chunk, embeddings[a:b])
                    diff = torch.maximum(diff, d.to(diff.device))
            if self.check_stages and float(diff) > self.stage_atol:
                raise ValueError(self._stage_check_message(float(diff)))

        grads = [v.value.grad if v.value.grad is not None else torch.zeros_like(v.value)
                 for v in variables]
        with torch.no_grad():
            if ranks > 1:
                distribute_torch.average_gradients(grads)
            self.optimizer.apply(grads, variables)
            if self.memory is not None:
                self.memory.enqueue(global_embeddings, global_y)
            self._update_trackers(total.detach(), memory_loss.detach()
                                  if torch.is_tensor(memory_loss) else memory_loss,
                                  diff, batch)
        # the global batch's metrics: every rank's callbacks decide alike
        return self.compute_metrics(x, global_y, global_embeddings,
                                    sample_weight=global_weight)
