from pyedgemoe.cli import main

main()
