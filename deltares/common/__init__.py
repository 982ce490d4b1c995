"""What every layer of deltares shares and none owns: the ranges of user-given numbers (`domains`).
Imports nothing else of deltares."""
