"""The test models of seed 000 §4 (SimpleMLP, CNNWithBN, ResNetBlock, RedundantModel)."""

import torch.nn.functional as F
from torch import nn


class SimpleMLP(nn.Module):
    def __init__(self, input_dim=32, hidden_dim=16, output_dim=4):
        super().__init__()
        self.fc1 = nn.Linear(input_dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, hidden_dim)
        self.fc3 = nn.Linear(hidden_dim, output_dim)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class ResNetBlock(nn.Module):
    def __init__(self, channels=4):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + x)


class RedundantModel(nn.Module):
    """Duplicated relu and a module called twice on the same input (seed 000 §3)."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(8, 8)

    def forward(self, x):
        a = F.relu(x)
        b = F.relu(x)
        feature1 = self.encoder(x)
        feature2 = self.encoder(x)
        return a + b + feature1 + feature2


class AddInsteadOfSub(nn.Module):
    def forward(self, x, y):
        return x + y * 2
