import torch
from transformers import AutoModelForSequenceClassification, Trainer, TrainingArguments


class Pooler(torch.nn.Module):
    def forward(self, hidden, mask):
        scores = hidden.mean(-1).masked_fill(mask == 0, -1e10)   # finding: -inf in float16
        bias = (1.0 - mask) * -1e9                              # finding: the same, additive
        return (scores + bias).softmax(-1)


def main(train_set):
    model = AutoModelForSequenceClassification.from_pretrained("bert-base-uncased")
    args = TrainingArguments("out", fp16=True, per_device_train_batch_size=8)
    Trainer(model=model, args=args, train_dataset=train_set).train()
