from coli.cli import main

raise SystemExit(main())
