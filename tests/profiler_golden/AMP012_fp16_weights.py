import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments


def finetune(train_set, loader):
    model = AutoModelForCausalLM.from_pretrained("gpt2", torch_dtype=torch.float16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)        # finding: default eps
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    args = TrainingArguments("out", learning_rate=1e-5)
    Trainer(model=model, args=args, train_dataset=train_set).train()  # finding: AdamW eps=1e-8
