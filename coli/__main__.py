from coli.cli import console

console()
