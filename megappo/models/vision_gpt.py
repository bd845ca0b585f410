"""Qwen2.5-VL on megatron: the language model is megatron-core's GPTModel with M-RoPE (`position_embedding_type=
'mrope'`, its MultimodalRotaryEmbedding), and the vision tower and merger are transformers' own module
(Qwen2_5_VisionTransformerPretrainedModel) on the first pipeline stage, whole on every TP rank.

Why HF's tower: megatron-core 0.19 has no Qwen2.5-VL encoder (windowed attention, 2-D RoPE, the 2 x 2 merger), and
Megatron-Bridge's Qwen2.5-VL wraps the same HF module. It is small beside the language model (0.7B of 7B), so TP
replicates it: each rank encodes the same images (duplicated compute, identical gradients; megatron counts a
replicated parameter once in the grad norm). Its parameters keep HF's names (`visual.*`), so the weight mapping,
the checkpoints and the rollout's weight sync carry them as they are.

The embedding runs unscattered (`scatter_embedding_sequence_parallel=False`), the image features replace the
image-pad tokens' embeddings (models/vision.images_of), then the sequence-parallel scatter: megatron-core's pattern
for multimodal language models.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

from megappo.models.vision import vision_tower


class VisionLanguageGPT(GPTModel):
    """GPTModel with a vision tower on its first stage. forward takes `images` (models/vision.images_of) and
    position_ids [b, s, 3] (M-RoPE; megatron's are [3, b, s]); a later stage ignores the images."""

    def __init__(self, *args, vision_config, freeze_vision: bool = False, **kwargs):
        super().__init__(*args, scatter_embedding_sequence_parallel=False, **kwargs)
        if self.pre_process:
            self.visual = vision_tower(vision_config, self.config.params_dtype)
            self.visual.requires_grad_(not freeze_vision)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, images=None, **kwargs):
        if position_ids.dim() == 3:
            position_ids = position_ids.permute(2, 0, 1)
        if self.pre_process and decoder_input is None:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h], whole
            if images is not None:
                decoder_input = self.with_images(decoder_input, *images)
            if self.config.sequence_parallel:
                decoder_input = scatter_to_sequence_parallel_region(decoder_input, group=self.pg_collection.tp)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs)

    def with_images(self, embeds: torch.Tensor, patches: torch.Tensor, grids: torch.Tensor,
                    where: torch.Tensor) -> torch.Tensor:
        """The embeddings [s, b, h] with the image features in place of the masked tokens (`where` [b, s]), taken
        in row order."""
        if not len(grids):
            return embeds
        features = self.visual(patches.to(self.visual.dtype), grid_thw=grids).pooler_output
        if int(where.sum()) != features.shape[0]:
            raise ValueError(f"the micro-batch's prompts hold {int(where.sum())} image-pad tokens, its images give "
                             f"{features.shape[0]} features: a row's image_grid_thw does not match its prompt")
        rows = embeds.transpose(0, 1).masked_scatter(where[..., None], features.to(embeds.dtype))
        return rows.transpose(0, 1).contiguous()
