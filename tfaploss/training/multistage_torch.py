"""MultiStageModel's step on the PyTorch backend: ``backward(gradient=G[chunk])``.

1. Stage 1 embeds each chunk under ``torch.no_grad()`` (no activations kept).
2. Stage 2 evaluates the loss on a detached copy of the embeddings that requires a
   gradient; ``backward()`` leaves ``G`` in its ``.grad`` and adds the weight
   regularisers' gradient to the variables' ``.grad``.
3. Stage 3 re-embeds each chunk with autograd on and calls
   ``e_chunk.backward(G[chunk])``; PyTorch accumulates into ``.grad`` across chunks.

With ``chunk_size=None`` stage 1 keeps its graph and stage 3 is one ``backward``.
"""

from __future__ import annotations

import keras
import torch
from keras import tree


def _slice(x, start, stop):
    return tree.map_structure(lambda t: t[start:stop], x)


class TorchSteps:
    """``train_step`` of ``MultiStageModel`` for ``KERAS_BACKEND=torch``."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._check_trainable()
        variables = self.trainable_variables
        batch = tree.flatten(x)[0].shape[0]
        self.zero_grad()

        if self.chunk_size is None:
            graph = self._embed(x)
            embeddings = graph.detach()
        else:
            bounds = self._chunk_bounds(batch)
            with torch.no_grad():
                embeddings = torch.cat([self._embed(_slice(x, a, b)) for a, b in bounds])

        leaf = embeddings.detach().requires_grad_(True)
        scaled, (total, memory_loss) = self._objective(y, leaf, sample_weight)
        scaled.backward()
        grad_embeddings = leaf.grad.to(embeddings.dtype)

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
            self.optimizer.apply(grads, variables)
            if self.memory is not None:
                self.memory.enqueue(embeddings, y)
            self._update_trackers(total.detach(), memory_loss.detach()
                                  if torch.is_tensor(memory_loss) else memory_loss,
                                  diff, batch)
        return self.compute_metrics(x, y, embeddings, sample_weight=sample_weight)
