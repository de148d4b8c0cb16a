import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM


def token_log_probs(logits, labels):
    log_probs = F.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


class Policy(torch.nn.Module):
    def __init__(self, path, bf16=True):
        super().__init__()
        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16 if bf16 else "auto")
        self.lm_loss = torch.nn.CrossEntropyLoss(ignore_index=-100)

    def action_log_probs(self, sequences):
        output = self.model(sequences)
        return token_log_probs(output["logits"][:, :-1, :], sequences[:, 1:])

    def sft_loss(self, input_ids, labels):
        shift_logits = self.model(input_ids).logits[..., :-1, :].float()
        return self.lm_loss(shift_logits.reshape(-1, shift_logits.size(-1)), labels[..., 1:].reshape(-1))
