"""Count every test in JUnit XML files (cmocka's and pytest's) and print one
summary line: N passed, N failed, N skipped. Exit 1 when any failed."""
import sys
import xml.etree.ElementTree as ET

total = {"passed": 0, "failed": 0, "skipped": 0}
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as e:
        print(f"summary: {path}: unreadable results ({e})")
        total["failed"] += 1
        continue
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            total["failed"] += 1
        elif case.find("skipped") is not None:
            total["skipped"] += 1
        else:
            total["passed"] += 1
print(f"TOTAL: {total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped "
      f"({len(sys.argv) - 1} result files)")
sys.exit(1 if total["failed"] else 0)
