import unittest

import avoid


class AvoidTest(unittest.TestCase):
    def test_a_labelled_node_takes_only_pods_that_accept_its_value(self):
        labels = {"trellis.dev/avoid": "maintenance"}
        self.assertEqual(avoid.rejects(labels, avoid.DEFAULT_LABEL, None),
                         "node(s) are avoided (trellis.dev/avoid: maintenance)")
        self.assertIsNone(avoid.rejects(labels, avoid.DEFAULT_LABEL, "maintenance"))
        self.assertIsNone(avoid.rejects({}, avoid.DEFAULT_LABEL, None))

    def test_a_pod_accepts_by_its_annotation(self):
        pod = {"metadata": {"annotations": {"trellis.dev/avoid": "maintenance"}}}
        self.assertEqual(avoid.accepted(pod, avoid.DEFAULT_LABEL), "maintenance")
        self.assertIsNone(avoid.accepted({"metadata": {}}, avoid.DEFAULT_LABEL))

    def test_the_configuration_is_checked(self):
        self.assertEqual(avoid.parse_configuration('{"label": "x/y"}'), "x/y")
        self.assertEqual(avoid.parse_configuration(""), avoid.DEFAULT_LABEL)
        with self.assertRaisesRegex(ValueError, "unknown field 'lable'"):
            avoid.parse_configuration('{"lable": "x"}')


if __name__ == "__main__":
    unittest.main()
