import sys

from executor_svc.executor import main

sys.exit(main())
