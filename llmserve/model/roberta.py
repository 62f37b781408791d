"""RoBERTa and XLM-RoBERTa encoders (bge-m3, multilingual-e5, bge-reranker's cross-encoders), read top to
bottom: BERT's encoder (`llmserve.model.bert`) with two differences in the embeddings. Position ids start
after the padding token's (transformers numbers a sequence's tokens from `pad_token_id + 1`, so the table's
first rows are never read and the model takes `max_position_embeddings - pad_token_id - 1` tokens), and a
single token type (transformers' RoBERTa tokenizers give no token types, so a pair is all type 0). The sequence-classification head is on the first token (`<s>`): `classifier.dense`, tanh,
`classifier.out_proj`.
"""

from __future__ import annotations

from llmserve.model.bert import BertForSequenceClassification, BertModel
from llmserve.model.config import ModelConfig


class RobertaModel(BertModel):
    weight_prefix = "roberta."
    uses_token_types = False

    @staticmethod
    def position_offset(cfg: ModelConfig) -> int:
        return int(cfg.raw.get("pad_token_id", 1)) + 1


class RobertaForSequenceClassification(BertForSequenceClassification):
    encoder_class = RobertaModel
    uses_token_types = False
    head_weights = {"classifier.dense.": "dense.", "classifier.out_proj.": "out."}
