"""What every layer of deltares shares and none owns: the ranges of user-given numbers (`domains`) and the
one way a command names the files it reads (`inputs`). Imports nothing else of deltares."""
